"""Refusals on the audit log without amplification: a site refused in a loop adds one row per round, not one
per call.

Each row keeps the round, a count, the first and last times (`at`, `last_at`) and the first refusal's detail (cut
to MAX_DETAIL_CHARS): what an operator needs to see that a site misbehaves, and no more whatever it sends.
"""

from __future__ import annotations

from datetime import UTC

from sqlalchemy import select, update

from hydrafl.bounded import bounded
from hydrafl.server.store import Store
from hydrafl.server.tables import AuditEvent, now

REFUSAL_ROW_S = 600.0
"""A site's refusals of one round are counted on one row while they keep coming: a refusal more than this long
after the row's last one starts a new row (so does a refusal of another run or round)."""


def record_refusal(
    store: Store, site_name: str, detail: str, run_id: int | None, server_round: int | None
) -> None:
    """Record that the coordinator refused a call of `site_name`: counted on the site's latest `update-rejected`
    row when that row is of the same run and round and its last refusal is under REFUSAL_ROW_S old, else a new
    row. Concurrent refusals each add one to the count (an UPDATE of the count, not a read and a write)."""
    moment = now()
    with store.session() as session, session.begin():
        latest = session.scalar(
            select(AuditEvent)
            .where(AuditEvent.kind == "update-rejected", AuditEvent.site_name == site_name)
            .order_by(AuditEvent.id.desc())
            .limit(1)
        )
        if latest is not None and (latest.run_id, latest.server_round) == (run_id, server_round):
            last = (
                latest.last_at or latest.at
            )  # SQLite returns naive datetimes; every stored one is UTC
            if (moment - last.replace(tzinfo=last.tzinfo or UTC)).total_seconds() < REFUSAL_ROW_S:
                counted = update(AuditEvent).where(AuditEvent.id == latest.id)
                session.execute(counted.values(count=AuditEvent.count + 1, last_at=moment))
                return
        session.add(
            AuditEvent(
                kind="update-rejected",
                at=moment,
                site_name=site_name,
                run_id=run_id,
                server_round=server_round,
                detail=bounded(detail),
            )
        )
