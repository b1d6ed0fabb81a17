"""Per-round checkpoints of a run: global arrays, the strategy's own state, and the history so far.

Written atomically (temp file + rename) so a crash mid-write leaves the previous round's checkpoint intact.
`checkpoint.pkl` is always the newest; `archive_checkpoint` also keeps the last few rounds' checkpoints under
`checkpoints/` (hard links, so the newest costs no second copy) for an operator to go back to.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pkl"
ARCHIVE_DIR = "checkpoints"
RUN_LENGTH_KEYS = ("rounds", "resume")
"""Run config keys a resume may change: how long the run goes on, and whether it resumes."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or was written by a different configuration."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    server_round: int
    arrays: ArrayRecord
    strategy_state: dict[str, Any]
    history: list[dict[str, Any]]
    run_config: dict[str, Any]


def save_checkpoint(run_dir: Path, checkpoint: Checkpoint) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    temporary = run_dir / f".{CHECKPOINT_FILE}.tmp"
    with temporary.open("wb") as handle:
        pickle.dump(checkpoint, handle, protocol=pickle.HIGHEST_PROTOCOL)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, run_dir / CHECKPOINT_FILE)


def load_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The run's last checkpoint, or None when the run never finished a round. Only load run directories
    you created: the file is a pickle."""
    path = run_dir / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        with path.open("rb") as handle:
            checkpoint = pickle.load(handle)
    except (pickle.UnpicklingError, EOFError, AttributeError) as error:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({error}); delete it to start over"
        ) from error
    if not isinstance(checkpoint, Checkpoint):
        raise CheckpointError(f"{path} is not a hydrafl checkpoint")
    return checkpoint


def resume_checkpoint(
    run_dir: Path | None, run_config: dict[str, Any], defaults: dict[str, Any]
) -> Checkpoint | None:
    """The checkpoint a run with `run_config` resumes from, None when there is none yet. A key the checkpoint
    lacks was added by a later hydrafl: at its default (`defaults`) the run goes on, with a warning (a
    coordinator upgraded mid-run keeps its runs); any other change of configuration refuses the resume."""
    if run_dir is None:
        raise CheckpointError("resume needs a run directory")
    checkpoint = load_checkpoint(run_dir)
    if checkpoint is None:
        return None
    saved = {k: v for k, v in checkpoint.run_config.items() if k not in RUN_LENGTH_KEYS}
    current = {k: v for k, v in run_config.items() if k not in RUN_LENGTH_KEYS}
    added = sorted(
        k for k in current.keys() - saved.keys() if k in defaults and current[k] == defaults[k]
    )
    # a saved key this run does not have (another strategy's knob in an older checkpoint) configures nothing
    changed = sorted(k for k in current if saved.get(k) != current[k] and k not in added)
    if changed:
        raise CheckpointError(
            f"cannot resume {run_dir}: configuration changed since it was written ({', '.join(changed)})"
        )
    if added:
        log.warning(
            "resuming %s, written before these keys existed; they take their defaults: %s",
            run_dir,
            ", ".join(f"{k}={defaults[k]!r}" for k in added),
        )
    return checkpoint


def archive_checkpoint(run_dir: Path, server_round: int) -> None:
    """Keep `checkpoint.pkl`, just committed for `server_round`, as `checkpoints/round-NNNNN.pkl` too: a hard link,
    so the newest checkpoint costs no second copy (`stale_checkpoints` says which older ones may go)."""
    current = run_dir / CHECKPOINT_FILE
    kept = run_dir / ARCHIVE_DIR / f"round-{server_round:05d}.pkl"
    if not current.exists() or kept.exists():
        return
    kept.parent.mkdir(exist_ok=True)
    try:
        os.link(current, kept)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(current, kept)


def stale_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """The kept checkpoints older than the newest `keep` (the newest is `checkpoint.pkl` itself, never stale)."""
    rounds = sorted((run_dir / ARCHIVE_DIR).glob("round-*.pkl"))
    return rounds[: max(len(rounds) - keep, 0)]
