"""A reply kept out of aggregation (it failed its checks or screening) is recorded in the round, logged, and
audited where the grid keeps an audit trail (the coordinator's: `screening.AuditsRejections`)."""

from __future__ import annotations

import logging

from flwr.serverapp import Grid

from hydrafl.rounds import RoundRecord
from hydrafl.server.aggregation.screening import AuditsRejections

log = logging.getLogger(__name__)


class Rejections:
    """Where a round's rejections go: its record, the log, and `grid`'s audit trail if it keeps one."""

    def __init__(self, grid: Grid) -> None:
        self.audit = grid if isinstance(grid, AuditsRejections) else None

    def reject(self, server_round: int, node: int, reason: str, record: RoundRecord) -> None:
        record.rejected_per_site[str(node)] = reason
        log.warning("round %d: site %d rejected: %s", server_round, node, reason)
        if self.audit is not None:
            self.audit.record_rejection(node, server_round, reason)
