"""Where `hydrafl simulate` writes: every run its own folder, never two runs' files side by side.

Without `--out` a run gets a new folder under `hydrafl-runs/` named by its start time, and `hydrafl-runs/latest`
links to the newest; an explicit `--out` that already holds a run is refused unless the run resumes it, and
`--resume` without `--out` continues the newest run there.
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
STRATEGY_MARKERS = ("history.json", "checkpoint.json", "checkpoint.pkl")
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


def runs(root: Path = RUNS_DIR) -> list[Path]:
    """The folders under `root` that hold a run, newest first: the one `latest` links to, then by name (the
    start time) from the newest."""
    if not root.is_dir():
        return []
    found = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and earlier_run(p)),
        reverse=True,
    )
    link = root / LATEST
    newest = root / os.readlink(link) if link.is_symlink() else None
    return sorted(found, key=lambda p: p != newest)  # stable: the rest stay newest first


def describe_run(folder: Path) -> str:
    """A run folder as a line of the list `--resume` shows: its path, strategies and whether it finished."""
    state = "finished" if (folder / RUN_MARKERS[0]).exists() else "stopped"
    return f"{folder} ({', '.join(ran_strategies(folder)) or 'no strategy yet'}; {state})"


def ran_strategies(folder: Path) -> list[str]:
    """The strategies whose sub-folder in `folder` holds a history or a checkpoint."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_dir() and any((p / m).exists() for m in STRATEGY_MARKERS)
    )


SHOWN_RUNS = 10


def newest_run(strategies: tuple[str, ...], root: Path = RUNS_DIR) -> str:
    """The folder `--resume` without `--out` continues: the newest run under `root`, if it ran no strategy
    besides `strategies` (else it is another study, and the user chooses with --out among the runs listed)."""
    found = runs(root)
    if not found:
        raise ConfigError(
            f"--resume without --out continues the newest run in {root}/, and there is no run in "
            f"{root}/ to continue; leave --resume out to start one, or give --out DIR of a run"
        )
    others = sorted(set(ran_strategies(found[0])) - set(strategies))
    if others:
        listed = "; ".join(describe_run(folder) for folder in found[:SHOWN_RUNS])
        more = f" and {len(found) - SHOWN_RUNS} older" if len(found) > SHOWN_RUNS else ""
        raise ConfigError(
            f"--resume without --out continues the newest run, {found[0]}, but it ran "
            f"{', '.join(others)}, which --strategies {','.join(strategies)} does not; give --out DIR "
            f"--resume with one of the runs in {root}/: {listed}{more}"
        )
    return str(found[0])


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
