"""How a site's training processes are started: torch.distributed.elastic's agent, as torchrun starts them.

On one host the agent hosts a c10d rendezvous on loopback (`torchrun --standalone`); on several, each host's
agent joins the site's rendezvous (`hydrafl.kernels.multi_host`). Either way the agent restarts every rank when
one dies, up to `max_restarts` times, and the process keeps its own signal handlers.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["elastic_run", "free_port", "one_host_config"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def one_host_config(*, nproc: int, max_restarts: int, log_dir: Path) -> LaunchConfig:
    """The agent's settings for `nproc` ranks on this host alone."""
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hydrafl-{uuid.uuid4().hex}",
        rdzv_backend="c10d",  # torchrun --standalone: the agent hosts the rendezvous store on loopback
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        local_addr="127.0.0.1",  # the ranks' MASTER_ADDR; else the host name, which need not resolve
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )


def elastic_run(launch: LaunchConfig, entry: Callable[..., Any], *args: Any) -> None:
    """`entry(*args)` in every rank the agent starts; ChildFailedError once the restarts are spent."""
    # A fresh store for the ranks of each rendezvous round, hosted by rank 0, rather than the agents' shared
    # one: agents on different hosts may count restarts differently, so no per-attempt key would match.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with _process_signal_handlers():
        elastic_launch(launch, entry)(*args)


_AGENT_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


@contextmanager
def _process_signal_handlers() -> Iterator[None]:
    """The process's own signal handlers, back after the launch. The elastic agent installs handlers that raise
    `SignalException` (an ordinary Exception) and leaves them in place: a site would then take Ctrl-C or a
    container stop for a failed round and carry on. A signal during the launch is delivered as the process
    would have had it: SIGINT as KeyboardInterrupt, others to the restored handler."""
    if (
        threading.current_thread() is not threading.main_thread()
    ):  # handlers can only change on the main thread
        yield
        return
    saved = {
        sig: handler for sig in _AGENT_SIGNALS if (handler := signal.getsignal(sig)) is not None
    }

    def restore() -> None:
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    try:
        yield
    except SignalException as error:
        restore()
        if error.sigval == signal.SIGINT:
            raise KeyboardInterrupt from error
        signal.raise_signal(error.sigval)
        raise
    finally:
        restore()
