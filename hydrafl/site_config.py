"""What one site declares about itself: its data, its hardware, where it may load checkpoints from.

`hydrafl site` builds a `SiteConfig` from its flags once; the site's ClientApp reads it back from Flower's flat
`node_config` (`SiteConfig.from_node_config`), which refuses a key it does not know, so a misspelt key fails
loudly instead of silently falling back to the run's setting. The simulation's grids set `partition-id`,
`num-partitions`, the simulated consortium's `dedup-key` and, for the full-data reference site, `pooled`.
Torch-free: the command line imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydrafl.catalog import SITE_TIERS
from hydrafl.validation import ConfigError


def _key(key: str, kind: type, flag: str = "") -> dict[str, Any]:
    """Field metadata: its node_config key, its value type there, and the `hydrafl site` flag that sets it."""
    return {"key": key, "kind": kind, "flag": flag}


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteConfig:
    """One site's own settings, which win over the run's (a site knows its hardware and data best)."""

    data_path: Path | None = field(default=None, metadata=_key("data-path", Path, "--data"))
    """This site's CSV/JSONL file or image folder; None makes a demo site (the run task's synthetic cohort)."""
    label_column: str = field(default="", metadata=_key("label-column", str, "--label-column"))
    """Label column of a CSV/JSONL `data_path`."""
    model_dir: Path | None = field(default=None, metadata=_key("model-dir", Path, "--model-dir"))
    """The only folder a run may name local checkpoints from; None allows the built-in models only."""
    state_dir: Path | None = field(default=None, metadata=_key("state-dir", Path, "--state-dir"))
    """Where the site keeps what must outlive a restart (its compression residuals); None: in memory only."""
    nproc: int | None = field(default=None, metadata=_key("nproc", int, "--nproc"))
    """Training processes (DDP); None takes the run's."""
    max_restarts: int = field(default=0, metadata=_key("max-restarts", int, "--max-restarts"))
    """With nproc > 1: how often the training processes are restarted when one dies."""
    nnodes: int = field(default=1, metadata=_key("nnodes", int, "--nnodes"))
    """Hosts this site trains on, `nproc` processes each; this process is the one that talks to the coordinator."""
    rdzv: str = field(default="", metadata=_key("rdzv", str, "--rdzv"))
    """With nnodes > 1: HOST:PORT of the site's rendezvous store, hosted by this process for the other hosts."""
    bf16: bool | None = field(default=None, metadata=_key("bf16", bool, "--bf16"))
    """Train under bfloat16 autocast; None takes the run's."""
    stream_layers: bool | None = field(
        default=None, metadata=_key("stream-layers", bool, "--stream-layers")
    )
    """Stream the transformer blocks through the device a window at a time; None takes the run's."""
    window: int | None = field(default=None, metadata=_key("window", int, "--window"))
    """Blocks materialised at once when streaming; None takes the run's."""
    memory_mb: float | None = field(default=None, metadata=_key("memory-mb", float, "--memory-mb"))
    """Training memory the site offers (0 = no limit); None takes its entry of the run's `site_memory_mb`."""
    speed: float | None = field(default=None, metadata=_key("speed", float))
    """Relative speed (1.0 = as measured); None takes its entry of the run's `site_speeds`."""
    tier: str = field(default="", metadata=_key("tier", str, "--tier"))
    """Resource tier (one of SITE_TIERS); "" takes its entry of the run's `site_tiers`."""
    demo_site: int | None = field(default=None, metadata=_key("demo-site", int))
    """A demo site's index in the synthetic cohort (the coordinator assigns it when the site joins)."""
    partition_id: int | None = field(default=None, metadata=_key("partition-id", int))
    """A simulated site's index in the run's cohort."""
    num_partitions: int | None = field(default=None, metadata=_key("num-partitions", int))
    """How many sites the simulation has (Flower's simulation engines set it with `partition_id`)."""
    pooled: bool = field(default=False, metadata=_key("pooled", bool))
    """The simulation's reference site, which trains on every site's training data together."""
    dedup_key: str = field(
        default="", repr=False, metadata=_key("dedup-key", str, "--dedup-key-file")
    )
    """The consortium's deduplication secret, hex (`hydrafl.client.dedup`); "" takes no part in deduplication.
    The site's own: it never travels."""

    def __post_init__(self) -> None:
        least = {
            "nproc": 1,
            "window": 1,
            "max_restarts": 0,
            "nnodes": 1,
            "memory_mb": 0,
            "demo_site": 0,
            "partition_id": 0,
            "num_partitions": 1,
        }
        for name, minimum in least.items():
            value = getattr(self, name)
            if value is not None and value < minimum:
                raise ConfigError(f"{_flag(name)} must be at least {minimum}, got {value!r}")
        if self.speed is not None and not self.speed > 0:
            raise ConfigError(f"{_flag('speed')} must be positive, got {self.speed!r}")
        if self.tier and self.tier not in SITE_TIERS:
            raise ConfigError(
                f"{_flag('tier')} {self.tier!r}: choose one of {', '.join(SITE_TIERS)}"
            )
        if self.nnodes > 1 and not self.rdzv:
            raise ConfigError(f"{_flag('nnodes')} {self.nnodes} needs {_flag('rdzv')} HOST:PORT")
        if self.dedup_key:
            _check_dedup_key(self.dedup_key)
        if self.label_column and self.data_path is None:
            raise ConfigError(f"{_flag('label_column')} needs {_flag('data_path')}")

    @property
    def deployed(self) -> bool:
        """A site started by `hydrafl site` (its own data or a demo cohort), not one the simulation made up."""
        return self.data_path is not None or self.demo_site is not None

    @property
    def index(self) -> int:
        """This site's position among the run's sites (its seed and its entry of per-site run settings)."""
        for value in (self.partition_id, self.demo_site):
            if value is not None:
                return value
        return 0

    def to_node_config(self) -> dict[str, bool | int | float | str]:
        """Flower's flat node_config: the fields that are set, paths as strings."""
        node_config: dict[str, bool | int | float | str] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is not None and value != spec.default:
                node_config[spec.metadata["key"]] = str(value) if isinstance(value, Path) else value
        return node_config

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> SiteConfig:
        """Read a node_config back; a key this class does not know, or a value of the wrong type, is a
        ConfigError that names the key."""
        specs = {spec.metadata["key"]: spec for spec in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in node_config.items():
            if key not in specs:
                raise ConfigError(
                    f"unknown node_config key {key!r}; valid keys: {', '.join(sorted(specs))}"
                )
            values[specs[key].name] = _typed(key, specs[key].metadata["kind"], value)
        return cls(**values)


def _check_dedup_key(hex_key: str) -> None:
    """16 to 64 bytes of hex: BLAKE2b's key sizes, and too many to guess."""
    try:
        size = len(bytes.fromhex(hex_key))
    except ValueError:
        raise ConfigError(
            f"{_flag('dedup_key')} must hold hex text (e.g. from `openssl rand -hex 32`)"
        ) from None
    if not 16 <= size <= 64:
        raise ConfigError(
            f"{_flag('dedup_key')} must hold 16 to 64 bytes (32 to 128 hex digits), got {size}"
        )


def _flag(name: str) -> str:
    """How errors name a field: the `hydrafl site` flag that sets it, else its node_config key."""
    metadata = {spec.name: spec.metadata for spec in dataclasses.fields(SiteConfig)}[name]
    return metadata["flag"] or f"node_config {metadata['key']!r}"


def _typed(key: str, kind: type, value: Any) -> Any:
    """`value` as `kind`: an int where a float is expected, a string where a path is; nothing else converts."""
    if kind is Path and isinstance(value, str):
        return Path(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    expected = "str" if kind is Path else kind.__name__
    raise ConfigError(f"node_config {key!r} must be {expected}, got {value!r}")
