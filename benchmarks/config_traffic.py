"""How much run configuration travels and is re-validated: config keys and bytes per message, and how often
a run's settings are parsed and validated, on a 2-site, 1-round in-process run of each strategy.

    python -m hydrafl.benchmarks.config_traffic [--out DIR] [--quick]

Counts, not timings: the numbers are the same on an idle and a busy machine. Run-wide settings belong in the
site's Context once per run (`run_config`); a message should carry only what changes per round.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Message
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.site_config import SiteConfig
from hydrafl.updates import records

NAME = "config_traffic"
STRATEGIES = ("fedavg", "diloco", "hydra")
RUN = RunConfig(sites=2, rounds=1, local_steps=2, samples_per_site=64, batch_size=16)


@dataclass
class Traffic:
    """What one run sent as configuration and how often it validated settings."""

    keys: list[int] = field(default_factory=list)
    """Config keys per message, in the order the messages were sent."""
    nbytes: list[int] = field(default_factory=list)
    """Config bytes per message (keys and values as the wire's JSON-like form: `repr` of each)."""
    run_validations: int = 0
    """`RunConfig` objects built (each one runs every check of the run's settings)."""
    site_parses: int = 0
    """`SiteConfig` objects read back from a node_config."""

    def summary(self) -> dict[str, Any]:
        count = max(len(self.keys), 1)
        return {
            "messages": len(self.keys),
            "keys_per_message": round(sum(self.keys) / count, 1),
            "bytes_per_message": round(sum(self.nbytes) / count),
            "run_validations": self.run_validations,
            "site_parses": self.site_parses,
        }


class _CountingGrid(InProcessGrid):
    def __init__(self, traffic: Traffic, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.traffic = traffic

    def _deliver(self, message: Message) -> Message:
        self._count(message)
        return super()._deliver(message)

    def _count(self, message: Message) -> None:
        configs = records(message.content, ConfigRecord)
        self.traffic.keys.append(sum(len(config) for config in configs))
        self.traffic.nbytes.append(
            sum(len(repr(k)) + len(repr(v)) for config in configs for k, v in config.items())
        )


@contextmanager
def _counting(traffic: Traffic) -> Iterator[None]:
    """Counts every `RunConfig` built and every `SiteConfig` read while the run lasts."""
    run_init, site_read = RunConfig.__post_init__, SiteConfig.from_node_config.__func__

    def counted_run(self: RunConfig) -> None:
        traffic.run_validations += 1
        run_init(self)

    def counted_site(cls: type[SiteConfig], node_config: Any) -> SiteConfig:
        traffic.site_parses += 1
        return site_read(cls, node_config)

    RunConfig.__post_init__ = counted_run  # type: ignore[method-assign]
    SiteConfig.from_node_config = classmethod(counted_site)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        RunConfig.__post_init__ = run_init  # type: ignore[method-assign]
        SiteConfig.from_node_config = classmethod(site_read)  # type: ignore[method-assign,assignment]


def measure(strategy: str) -> dict[str, Any]:
    """One 2-site, 1-round run of `strategy`, counted from the ServerApp's start to its end."""
    cfg = RUN.replace(strategy=strategy)
    traffic = Traffic()
    site_app.forget_parsed_settings()  # each run counted as a fresh site process would see it
    with _counting(traffic):
        grid = _CountingGrid(traffic, site_app.client_app, cfg.sites, cfg.to_flower())
        server_app.run_federation(grid, cfg)
    return {"strategy": strategy, "run_keys": len(cfg.to_flower()), **traffic.summary()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = benchmark_parser(__doc__, "the same runs (they are already small)").parse_args(argv)
    rows = [measure(strategy) for strategy in STRATEGIES]
    table = Table(title="run configuration per message and per run (2 sites, 1 round)")
    for column in (
        "strategy",
        "run keys",
        "messages",
        "keys/msg",
        "bytes/msg",
        "RunConfig",
        "SiteConfig",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["strategy"],
            str(row["run_keys"]),
            str(row["messages"]),
            str(row["keys_per_message"]),
            str(row["bytes_per_message"]),
            str(row["run_validations"]),
            str(row["site_parses"]),
        )
    Console().print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    return {"runs": rows}


if __name__ == "__main__":
    main()
