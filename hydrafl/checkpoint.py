"""Per-round checkpoints of a run: global arrays, the strategy's own state, and the history so far.

Written atomically (temp file + rename) so a crash mid-write leaves the previous round's checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Strategy

CHECKPOINT_FILE = "checkpoint.pkl"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or was written by a different configuration."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    server_round: int
    arrays: ArrayRecord
    strategy_state: dict[str, Any]
    history: list[dict[str, Any]]
    run_config: dict[str, Any]


def strategy_state(strategy: Strategy) -> dict[str, Any]:
    """hydrafl strategies export `state_dict()`; Flower's keep state (FedOpt moments, FedAvgM momentum,
    current arrays) in plain attributes, which are saved whole."""
    if hasattr(strategy, "state_dict"):
        return strategy.state_dict()
    return dict(vars(strategy))


def restore_strategy_state(strategy: Strategy, state: dict[str, Any]) -> None:
    if hasattr(strategy, "load_state_dict"):
        strategy.load_state_dict(state)
    else:
        vars(strategy).update(state)


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
        raise CheckpointError(f"checkpoint {path} is unreadable ({error}); delete it to start over") from error
    if not isinstance(checkpoint, Checkpoint):
        raise CheckpointError(f"{path} is not a hydrafl checkpoint")
    return checkpoint
