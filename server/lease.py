"""The lease that lets one coordinator at a time drive the runs of a database: one fixed row, taken when free
or stale (or held by this coordinator's own dead process), renewed by heartbeats, released at a clean stop."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

from sqlalchemy import CursorResult, delete, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hydrafl.server.tables import AuditEvent, CoordinatorLease, now

LEASE_ROW = 1
"""The lease table's only row: a fixed primary key, so two coordinators can never both insert a lease."""
LEASE_ATTEMPTS = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseClaim:
    """A coordinator asking for the lease; `stale_s` is its promise of how long it may go without a heartbeat."""

    holder: str
    host: str
    pid: int
    listen: str
    stale_s: float
    restarted_from: str | None = None
    """The holder id of this coordinator's previous process, now gone (`coordinator.LeaseMark`): its lease on
    this host is taken at once (a container restarted with the same hostname and pid 1)."""


def _utc(moment: datetime) -> datetime:
    """SQLite returns naive datetimes; every stored one is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def lease_age_s(lease: CoordinatorLease) -> float:
    """Seconds since the holder's last heartbeat."""
    return (now() - _utc(lease.heartbeat_at)).total_seconds()


def describe_lease(lease: CoordinatorLease, age_s: float) -> str:
    return f"{lease.host} pid {lease.pid}, listening on {lease.listen}, last heartbeat {age_s:.1f} s ago"


class LeaseHeld(RuntimeError):
    """Another coordinator's lease on this database is fresh: a second one would drive the same runs."""

    def __init__(self, lease: CoordinatorLease, age_s: float) -> None:
        self.lease = lease
        wait_s = math.ceil(max(0.0, lease.stale_s - age_s))
        super().__init__(
            f"another coordinator holds this database: {describe_lease(lease, age_s)}. "
            f"Stop it, or wait {wait_s} s if it died "
            f"(its lease goes stale {lease.stale_s:g} s after its last heartbeat)"
        )


class LeaseRows:
    """The lease's operations on the database, each one transaction (mixed into `store.Store`)."""

    def session(self) -> Session:
        raise NotImplementedError

    def lease(self) -> CoordinatorLease | None:
        with self.session() as session:
            return session.get(CoordinatorLease, LEASE_ROW)

    def acquire_lease(self, claim: LeaseClaim) -> CoordinatorLease | None:
        """Take the database's coordinator lease; returns the stale lease taken over, None when it was free.

        Raises LeaseHeld while another holder's heartbeat is fresher than its `stale_s`. Race-safe on SQLite and
        PostgreSQL: a free lease is an insert of the one fixed primary key, and a takeover an UPDATE that matches
        only the holder and heartbeat read before, so of coordinators starting together exactly one wins.
        """
        for _ in range(LEASE_ATTEMPTS):
            if self._insert_lease(claim):
                return None
            current = self.lease()
            if current is None:  # released between the insert and the read
                continue
            age_s = lease_age_s(current)
            if (
                current.holder != claim.holder
                and age_s < current.stale_s
                and not _restarted_self(current, claim)
                and not _holder_died(current, claim)
            ):
                raise LeaseHeld(current, age_s)
            if self._swap_lease(current, claim, age_s):
                return current if current.holder != claim.holder else None
        raise RuntimeError(
            f"the coordinator lease changed hands {LEASE_ATTEMPTS} times while taking it; start again"
        )

    def _insert_lease(self, claim: LeaseClaim) -> bool:
        moment = now()
        try:
            with self.session() as session, session.begin():
                if session.get(CoordinatorLease, LEASE_ROW) is not None:
                    return False
                session.add(
                    CoordinatorLease(
                        id=LEASE_ROW,
                        holder=claim.holder,
                        host=claim.host,
                        pid=claim.pid,
                        listen=claim.listen,
                        stale_s=claim.stale_s,
                        acquired_at=moment,
                        heartbeat_at=moment,
                    )
                )
        except IntegrityError:  # another coordinator inserted it first
            return False
        return True

    def _swap_lease(self, seen: CoordinatorLease, claim: LeaseClaim, age_s: float) -> bool:
        """Replace the lease read as `seen`, unless it changed since (renewed or taken by someone else)."""
        moment = now()
        with self.session() as session, session.begin():
            swapped = session.execute(
                update(CoordinatorLease)
                .where(
                    CoordinatorLease.id == LEASE_ROW,
                    CoordinatorLease.holder == seen.holder,
                    CoordinatorLease.heartbeat_at == seen.heartbeat_at,
                )
                .values(
                    holder=claim.holder,
                    host=claim.host,
                    pid=claim.pid,
                    listen=claim.listen,
                    stale_s=claim.stale_s,
                    acquired_at=moment,
                    heartbeat_at=moment,
                )
            )
            taken = cast(CursorResult, swapped).rowcount == 1  # an UPDATE's result
            if taken and seen.holder != claim.holder:
                detail = f"from {describe_lease(seen, age_s)} (holder {seen.holder})"
                session.add(AuditEvent(kind="lease-taken-over", detail=detail))
        return taken

    def renew_lease(self, holder: str) -> bool:
        """Heartbeat; False when `holder` no longer holds the lease (another coordinator took it over)."""
        with self.session() as session, session.begin():
            renewed = session.execute(
                update(CoordinatorLease)
                .where(CoordinatorLease.id == LEASE_ROW, CoordinatorLease.holder == holder)
                .values(heartbeat_at=now())
            )
            return cast(CursorResult, renewed).rowcount == 1

    def release_lease(self, holder: str) -> None:
        """Give the lease up, so the next coordinator starts at once instead of waiting for it to go stale."""
        with self.session() as session, session.begin():
            session.execute(delete(CoordinatorLease).where(CoordinatorLease.holder == holder))


def _restarted_self(lease: CoordinatorLease, claim: LeaseClaim) -> bool:
    """Hostname and pid cannot tell a restart from another live container; the holder its folder recorded can."""
    return (
        claim.restarted_from is not None
        and lease.holder == claim.restarted_from
        and lease.host == claim.host
    )


def _holder_died(lease: CoordinatorLease, claim: LeaseClaim) -> bool:
    """A holder on this host whose process is gone (a coordinator killed with -9) holds nothing: a restart need
    not wait for its lease to go stale."""
    if lease.host != claim.host or lease.pid == claim.pid:
        return False
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
