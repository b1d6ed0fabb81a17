"""Where `hydrafl simulate` writes: every run its own folder, never two runs' files side by side.

Without `--out` a run gets a new folder under `hydrafl-runs/` named by its start time, and `hydrafl-runs/latest`
links to the newest; an explicit `--out` that already holds a run is refused unless the run resumes it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hydrafl.validation import ConfigError

RUNS_DIR = Path("hydrafl-runs")
LATEST = "latest"
RUN_MARKERS = ("results.json", "report.md")
"""Files a finished comparison leaves in its folder."""
STRATEGY_MARKERS = ("history.json", "checkpoint.pkl")
"""Files a strategy's run leaves in its sub-folder, also when it failed."""


def new_run_folder(root: Path = RUNS_DIR) -> str:
    """A folder name under `root` that no earlier run used: the local start time, then -2, -3... on a clash."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    candidate, n = root / stamp, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{stamp}-{n}"
    return str(candidate)


def earlier_run(out: Path) -> str | None:
    """What in `out` belongs to an earlier run (a file name), or None when `out` is new or holds no run."""
    if not out.is_dir():
        return None
    for name in RUN_MARKERS:
        if (out / name).exists():
            return name
    for child in sorted(p for p in out.iterdir() if p.is_dir()):
        for name in STRATEGY_MARKERS:
            if (child / name).exists():
                return f"{child.name}/{name}"
    return None


def claim(out: Path, resume: bool) -> None:
    """Create `out` for a run; refuse one holding another run's files unless this run resumes it."""
    found = earlier_run(out)
    if found and not resume:
        raise ConfigError(
            f"--out {out} already holds a run ({found}); give a new folder (or leave --out out for a fresh one "
            "under hydrafl-runs/), or add --resume to continue that run"
        )
    out.mkdir(parents=True, exist_ok=True)
    if out.parent.resolve() == RUNS_DIR.resolve() and out.name != LATEST:
        link_latest(out)


def link_latest(out: Path) -> None:
    """Point `hydrafl-runs/latest` at `out`, replacing the link atomically (a reader never sees it missing)."""
    link = out.parent / LATEST
    if link.exists() and not link.is_symlink():
        return  # an old hydrafl's results folder of that name: left alone, never deleted
    temporary = out.parent / f".{LATEST}.{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(out.name, target_is_directory=True)
    os.replace(temporary, link)
