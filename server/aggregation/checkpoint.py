"""Per-round checkpoints of a run: global arrays, the strategy's own state, and the history so far, read back bit
for bit by a resume, without pickle (reading one runs no code).

A checkpoint is two files in the run folder: `round-NNNNN-TOKEN.safetensors` holds every tensor (the global
arrays under `arrays[...]`, the strategy state's under their place in it, e.g. `strategy_state['m_t']['w']`) and
`checkpoint.json` everything else (the strategy state's other values, the history, the run config: encoded by
`state_codec`) and the name of its tensor file. The tensors are written and fsynced first, then the JSON goes
to a temp file, is fsynced and renamed over `checkpoint.json`: that rename commits, so a crash mid-write leaves
the previous round's checkpoint whole; tensor files no committed JSON names go after it. `archive_checkpoint`
keeps the last few rounds under `checkpoints/` (hard links, so the newest costs no second copy).

Checkpoints of earlier hydrafl were one pickle (`checkpoint.pkl`): read once, with a warning, and rewritten.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import secrets
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hydrafl.server.aggregation.state_codec import Encoder, StateCodecError, decode, without_code

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
PICKLE_FILE = "checkpoint.pkl"
"""What hydrafl wrote before checkpoints left pickle: resumed once, then rewritten as `CHECKPOINT_FILE`."""
ARCHIVE_DIR = "checkpoints"
FORMAT = "hydrafl-checkpoint/1"
RUN_LENGTH_KEYS = ("rounds", "resume")
"""Run config keys a resume may change: how long the run goes on, and whether it resumes."""
_ROUND_FILE = re.compile(r"round-(\d+)")


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
    """Commit `checkpoint` as the run's newest. CheckpointError names a value of the strategy's state that has
    no checkpoint form (`state_codec`): found before anything is written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(run_dir)
    try:
        record = {
            "format": FORMAT,
            "server_round": checkpoint.server_round,
            "arrays": encoder.encode(checkpoint.arrays, "arrays"),
            "strategy_state": encoder.encode(checkpoint.strategy_state, "strategy_state"),
            "history": encoder.encode(checkpoint.history, "history"),
            "run_config": encoder.encode(checkpoint.run_config, "run_config"),
        }
    except StateCodecError as error:
        raise CheckpointError(
            f"cannot checkpoint round {checkpoint.server_round}: {error}"
        ) from error
    tensors = f"round-{checkpoint.server_round:05d}-{secrets.token_hex(4)}.safetensors"
    save_file(encoder.tensors, run_dir / tensors, metadata={"format": FORMAT})
    _fsync(run_dir / tensors)
    temporary = run_dir / f".{CHECKPOINT_FILE}.tmp"
    files = sorted(encoder.files)
    temporary.write_text(
        json.dumps({**record, "tensors": tensors, "files": files}, allow_nan=False)
    )
    _fsync(temporary)
    os.replace(temporary, run_dir / CHECKPOINT_FILE)
    _fsync(run_dir)
    for stale in run_dir.glob("round-*.safetensors"):
        if stale.name != tensors and stale.name not in files:
            stale.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The run's last checkpoint, or None when the run never finished a round. An old pickled one is read (a
    pickle runs code: only the run's own folder is looked at, with a warning) and rewritten without pickle."""
    if (run_dir / CHECKPOINT_FILE).exists():
        return read_checkpoint(run_dir / CHECKPOINT_FILE)
    if (run_dir / PICKLE_FILE).exists():
        return _rewrite_pickle(run_dir)
    return None


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint whose JSON is `path` (`checkpoint.json`, or a kept `checkpoints/round-NNNNN.json`); its
    tensor file is beside it."""
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a hydrafl checkpoint")
        tensors = load_file(path.parent / record["tensors"])
        missing = [file for file in record.get("files", []) if not (path.parent / file).is_file()]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} names tensor file {missing[0]}, which is gone"
            )
        return Checkpoint(
            server_round=record["server_round"],
            arrays=decode(record["arrays"], tensors, path.parent),
            strategy_state=decode(record["strategy_state"], tensors, path.parent),
            history=decode(record["history"], tensors, path.parent),
            run_config=decode(record["run_config"], tensors, path.parent),
        )
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({error}); delete it to start over"
        ) from error


def _rewrite_pickle(run_dir: Path) -> Checkpoint:
    path = run_dir / PICKLE_FILE
    log.warning(
        "%s is a checkpoint of an earlier hydrafl: a pickle, which runs code when read, so only the run's own "
        "folder is read this way, once; it is rewritten as %s",
        path,
        CHECKPOINT_FILE,
    )
    try:
        with path.open("rb") as handle:
            old = pickle.load(handle)
    except (pickle.UnpicklingError, EOFError, AttributeError) as error:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({error}); delete it to start over"
        ) from error
    if not isinstance(old, Checkpoint):
        raise CheckpointError(f"{path} is not a hydrafl checkpoint")
    migrated = Checkpoint(
        server_round=old.server_round,
        arrays=old.arrays,
        strategy_state=without_code(old.strategy_state),
        history=old.history,
        run_config=old.run_config,
    )
    try:
        save_checkpoint(run_dir, migrated)
        path.unlink()
    except (
        OSError
    ) as error:  # a folder this process may only read (an export of another user's run)
        log.warning("could not rewrite %s (%s); it stays a pickle", path, error)
        return migrated
    return read_checkpoint(run_dir / CHECKPOINT_FILE)


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
    """Keep the checkpoint just committed for `server_round` as `checkpoints/round-NNNNN.json` and its tensor file
    beside it: hard links, so the newest checkpoint costs no second copy (`stale_checkpoints` says which older
    ones may go)."""
    current = run_dir / CHECKPOINT_FILE
    kept = run_dir / ARCHIVE_DIR / f"round-{server_round:05d}.json"
    if not current.exists() or kept.exists():
        return
    record = json.loads(current.read_text())
    kept.parent.mkdir(exist_ok=True)
    for name in [record["tensors"], *record.get("files", [])]:
        _link(run_dir / name, kept.parent / name)
    _link(current, kept)  # last: a kept JSON always has its tensors


def _link(source: Path, target: Path) -> None:
    if target.exists():
        return
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(source, target)


def stale_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """The files of the kept checkpoints older than the newest `keep` rounds (the newest is `checkpoint.json`
    itself, never stale), an earlier hydrafl's `round-NNNNN.pkl` among them."""
    rounds: dict[int, list[Path]] = defaultdict(list)
    for path in (run_dir / ARCHIVE_DIR).glob("round-*"):
        if match := _ROUND_FILE.match(path.name):
            rounds[int(match.group(1))].append(path)
    doomed = sorted(rounds)[: max(len(rounds) - keep, 0)]
    return [path for server_round in doomed for path in sorted(rounds[server_round])]
