"""A site's training across several hosts: torch's elastic agent on each host, one c10d rendezvous per round.

The host that talks to the coordinator (node rank 0, the leader) hosts the site's rendezvous store at
`--rdzv HOST:PORT` for as long as the site runs, and announces in it each round's rendezvous id. Every other host
(`hydrafl site --node-rank R`, R >= 1) waits there for the next id and starts its local ranks through the
elastic agent into that rendezvous, as `torchrun --rdzv-backend c10d` would; the agents restart their ranks
when one dies (`--max-restarts`), as on one host. Ranks of all hosts form one process group, and the round's job
(model builder, start state, the site's data) reaches the other hosts' ranks by a broadcast from the leader's,
so only the leader holds a connection to the coordinator and the site's data stays inside the site.

The rendezvous assigns global ranks in the order hosts join, so whichever rank is 0, the leader's local rank 0
writes the round's result.
"""

from __future__ import annotations

import functools
import logging
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "JOIN_TIMEOUT_S",
    "RoundAnnouncement",
    "host_address",
    "launch_config",
    "parse_endpoint",
    "serve_training_host",
    "site_store",
]

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300
"""How long a round's rendezvous waits for every host; a host that is down fails the round after this."""
_ROUNDS, _ROUND, _DONE = "hydrafl/rounds", "hydrafl/round", "hydrafl/done"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) of the site's rendezvous store."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def host_address(endpoint: str) -> str:
    """This host's address on the interface that reaches the leader: what the other hosts' ranks connect to
    (a host name need not resolve across a hospital's machines; the route to the leader is known to work)."""
    host, port = parse_endpoint(endpoint)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # a datagram socket sends nothing: this only picks the route
        return str(probe.getsockname()[0])


@functools.cache
def site_store(endpoint: str) -> dist.TCPStore:
    """The leader's rendezvous store, bound once for the life of the site process."""
    host, port = parse_endpoint(endpoint)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True)


class RoundAnnouncement:
    """One round's rendezvous id, announced in the site's store for the other hosts, and marked done after."""

    def __init__(self, endpoint: str) -> None:
        self.store = site_store(endpoint)
        self.number = self.store.add(_ROUNDS, 1)
        self.run_id = f"hydrafl-site-{uuid.uuid4().hex}"
        self.store.set(f"{_ROUND}/{self.number}", self.run_id)

    def done(self) -> None:
        self.store.set(f"{_DONE}/{self.number}", "1")


def launch_config(
    *, nnodes: int, nproc: int, run_id: str, endpoint: str, max_restarts: int, log_dir: Path
) -> LaunchConfig:
    """The elastic agent's settings for one round on this host: `nnodes` hosts of `nproc` ranks, joining the
    rendezvous `run_id` through the leader's store (which no agent hosts: the leader's site process does)."""
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": False, "join_timeout": JOIN_TIMEOUT_S},
        local_addr=host_address(endpoint),
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )


def serve_training_host(
    endpoint: str,
    run_round: Callable[[str], None],
    *,
    rounds: int | None = None,
    retry_s: float = 2.0,
) -> int:
    """Take part in every round the leader at `endpoint` announces (all of them, or `rounds`) by calling
    `run_round(rendezvous_id)`, waiting for the leader when it is not up yet or restarts; how many rounds this
    host trained in."""
    trained = 0
    while rounds is None or trained < rounds:
        try:
            store = _connect(endpoint)
            number = _next_round(store)
            while rounds is None or trained < rounds:
                run_id = _wait(store, f"{_ROUND}/{number}").decode()
                if not store.check([f"{_DONE}/{number}"]):
                    log.info("round rendezvous %s: starting this host's ranks", run_id)
                    try:
                        run_round(run_id)
                    except (
                        Exception
                    ) as error:  # the leader reports the failed round; this host serves on
                        log.warning("round rendezvous %s failed on this host: %s", run_id, error)
                    trained += 1
                number += 1
        except (dist.DistStoreError, dist.DistNetworkError, ConnectionError) as error:
            log.warning("the site's leader at %s is not reachable (%s); retrying", endpoint, error)
            time.sleep(retry_s)
    return trained


def _connect(endpoint: str) -> dist.TCPStore:
    host, port = parse_endpoint(endpoint)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)


def _next_round(store: dist.TCPStore) -> int:
    """The round to join: the one announced last when it is still open, else the next one."""
    last = store.add(_ROUNDS, 0)
    return last if last and not store.check([f"{_DONE}/{last}"]) else last + 1


def _wait(store: dist.TCPStore, key: str) -> bytes:
    """The value of `key` once the leader sets it, however long that takes (a round comes when the coordinator
    sends one); a leader that goes away raises a store error. Polled: a blocking wait logs every time out."""
    while not store.check([key]):
        time.sleep(0.5)
    return store.get(key)
