"""The record step: after each round, one log line and, in a run directory, the checkpoint (global arrays,
the strategy's state, the history so far: a resume ends with the same numbers), `rounds.tsv` (the timing and
bytes schema every runtime shares) and `history.json` (every round's whole record)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Strategy

from hydrafl.rounds import ROUNDS_TSV_COLUMNS, RoundRecord, metric
from hydrafl.server.aggregation.checkpoint import Checkpoint, save_checkpoint
from hydrafl.strategies import hooks

log = logging.getLogger(__name__)


class RunLog:
    """Where a run's rounds are recorded: the log, and `run_dir` unless None (a run kept in memory)."""

    def __init__(
        self, run_dir: Path | None, strategy: Strategy, run_config: dict[str, Any]
    ) -> None:
        self.run_dir = run_dir
        self.strategy = strategy
        self.run_config = run_config

    def write(
        self, record: RoundRecord, history: list[dict[str, Any]], arrays: ArrayRecord
    ) -> None:
        """Record the round `record` ended with `arrays`; `history` already holds it."""
        log.info(
            "round %d: loss=%s accuracy=%s sites=%d/%d up=%dB down=%dB %.2fs",
            record.round,
            metric(record.loss),
            metric(record.accuracy),
            record.sites_ok,
            record.sites_ok + record.sites_failed,
            record.bytes_up,
            record.bytes_down,
            record.seconds,
        )
        if self.run_dir is None:
            return
        save_checkpoint(
            self.run_dir,
            Checkpoint(
                server_round=record.round,
                arrays=arrays,
                strategy_state=hooks.strategy_state(self.strategy),
                history=history,
                run_config=self.run_config,
            ),
        )
        rows = [RoundRecord(**entry).tsv_row() for entry in history]
        (self.run_dir / "rounds.tsv").write_text(
            "\n".join(["\t".join(ROUNDS_TSV_COLUMNS), *rows]) + "\n"
        )
        (self.run_dir / "history.json").write_text(json.dumps(history, indent=1))
