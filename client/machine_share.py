"""How many torch threads a site trains with: its share of the machine's cores among the hydrafl sites running on
it, so three sites on one laptop do not each take every core (measured: a 3-site round on 2 cores took 6.5 s
with every site at 2 threads, 0.97 s at 1), while a site alone on a dedicated server takes them all.

Each site process registers itself with a file in a per-user folder and holds an exclusive lock on it while it
lives (the kernel drops the lock when the process dies, kill -9 included): the live sites are the locked files.
The share is taken again before every message, so a site that started alone gives cores back when others join.
`hydrafl site --threads N` fixes the count instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"hydrafl-sites-{os.getuid()}"


class MachineShare:
    """This site's registration among the sites of this machine; `threads` is its share of the cores."""

    def __init__(self, folder: Path | None = None, *, fixed: int = 0) -> None:
        self.fixed = fixed
        """Threads set by the operator (`--threads`); 0 takes the share."""
        self.folder = folder or default_folder()
        self._file: IO[str] | None = None
        if not fixed:
            self._register()

    def _register(self) -> None:
        try:
            self.folder.mkdir(mode=0o700, exist_ok=True)
            handle = (self.folder / f"{os.getpid()}.site").open("w")
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:  # counted as alone: the share is then every core, as before
            log.warning("cannot register with the other sites of this machine (%s)", error)
            return
        self._file = handle

    def live_sites(self) -> int:
        """The sites of this machine that hold their registration (this one included); stale files go."""
        count = 0
        for path in self.folder.glob("*.site"):
            if self._file is not None and path.name == Path(self._file.name).name:
                count += 1
                continue
            try:
                with path.open("a") as other:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink(missing_ok=True)  # its process is gone
            except BlockingIOError:
                count += 1
            except OSError:
                continue
        return max(count, 1)

    def threads(self, processes: int = 1) -> int:
        """Torch threads for each of this site's `processes` training processes."""
        if self.fixed:
            return max(1, self.fixed // processes)
        return max(1, machine_cores() // (self.live_sites() * processes))

    def release(self) -> None:
        if self._file is not None:
            path = Path(self._file.name)
            self._file.close()
            path.unlink(missing_ok=True)
            self._file = None
