"""Each run's log lines, kept in its run folder while the coordinator drives it, so an administrator reads them
later or from another machine (`hydrafl admin run logs`), as Flower users do with `flwr log`."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hydrafl.bounded import BoundedRecords

RUN_LOG = "coordinator.log"
MAX_READ_BYTES = 256 << 10
"""The most one read of a run's log returns; a follower asks again from where it stopped."""
LOGGERS = ("hydrafl", "flwr")


@contextmanager
def run_log(run_dir: Path) -> Iterator[None]:
    """While the run is driven, what the coordinator logs (its own lines and Flower's, at the levels it logs them)
    is also appended to the run's log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / RUN_LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(BoundedRecords())
    for name in LOGGERS:
        logging.getLogger(name).addHandler(handler)
    try:
        yield
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        handler.close()


@dataclass(frozen=True, slots=True)
class LogLines:
    lines: list[str]
    offset: int
    """Where the next read starts: the byte after the last whole line returned."""


def read_log(run_dir: Path, offset: int, max_bytes: int = MAX_READ_BYTES) -> LogLines:
    """The whole lines of the run's log from byte `offset`, at most `max_bytes` of them (at least one line)."""
    try:
        with (run_dir / RUN_LOG).open("rb") as file:
            file.seek(max(offset, 0))
            data = file.read(max_bytes)
            if b"\n" not in data:
                data += file.readline()
    except FileNotFoundError:
        return LogLines([], 0)
    whole = data[: data.rfind(b"\n") + 1]
    text = whole.decode("utf-8", errors="replace")
    return LogLines(text.splitlines(), max(offset, 0) + len(whole))
