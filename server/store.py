"""The coordinator's persistent state (SQLAlchemy): sites, runs, messages, replies, metrics, audit events, and
the lease that lets one coordinator at a time drive the runs of a database.

SQLite file by default, any SQLAlchemy URL (PostgreSQL) by `--db`. Array bytes are not here: envelopes
refer to chunks in the blob store by hash.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    Select,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from hydrafl.bounded import bounded
from hydrafl.server.migrations import prepare_schema

FIRST_NODE_ID = 10_001
LEASE_ROW = 1
"""The lease table's only row: a fixed primary key, so two coordinators can never both insert a lease."""
LEASE_ATTEMPTS = 3


def now() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Site(Base):
    __tablename__ = "sites"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    node_id: Mapped[int] = mapped_column(BigInteger, unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)


STOCK_ROUNDS_KEY = "num-server-rounds"


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    config: Mapped[dict] = mapped_column(JSON)
    """hydrafl's run keys; for a stock Flower ServerApp, its typed run_config (`--run-config`)."""
    server_app: Mapped[str | None] = mapped_column(String(255), nullable=True)
    """A stock Flower ServerApp's module:attribute reference, or None for a run of hydrafl's own ServerApp."""
    status: Mapped[str] = mapped_column(String(16), default="pending")
    """pending -> running -> finished | failed"""
    rounds_done: Mapped[int] = mapped_column(Integer, default=0)
    history: Mapped[list] = mapped_column(JSON, default=list)
    """Per-round records (loss, accuracy, bytes, timings), as in the simulation's results.json."""
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    @property
    def total_rounds(self) -> object:
        """The rounds the run was created with: `rounds`, or a stock ServerApp's `num-server-rounds` (the key
        Flower's app templates read), as stored (None when the run config has none)."""
        return self.config.get(STOCK_ROUNDS_KEY if self.server_app else "rounds")


class OutboundMessage(Base):
    """A message the coordinator addressed to a site (an assignment)."""

    __tablename__ = "messages"
    message_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    server_round: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[int] = mapped_column(BigInteger, index=True)
    envelope: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    closed: Mapped[bool] = mapped_column(Boolean, default=False)
    """Set when the round's deadline passed without this reply: a late reply is refused."""


class Reply(Base):
    """A site's accepted reply; at most one per outbound message (pushes are idempotent)."""

    __tablename__ = "replies"
    __table_args__ = (UniqueConstraint("reply_to_message_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    reply_to_message_id: Mapped[str] = mapped_column(ForeignKey("messages.message_id"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    server_round: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[int] = mapped_column(BigInteger)
    envelope: Mapped[bytes] = mapped_column(LargeBinary)
    accepted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)


class AuditEvent(Base):
    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_kind_site", "kind", "site_name", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    kind: Mapped[str] = mapped_column(String(32))
    """enrolled, revoked, update-accepted, update-rejected, run-started, run-finished, run-failed, site-declined,
    lease-taken-over"""
    site_name: Mapped[str] = mapped_column(String(128), default="")
    run_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")
    """Cut to MAX_DETAIL_CHARS (`hydrafl.bounded`); of counted refusals, the first one's."""
    server_round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """Refusals of one site in one round (`server_round`, when the refused call named one) counted on this row
    (`audit.record_refusal`); 1 for any other event."""
    last_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    """When the last refusal counted on this row came (`at` is the first); None for a single event."""


class CoordinatorLease(Base):
    """Which coordinator drives this database's runs. Its holder renews `heartbeat_at` every `stale_s` / 6 s;
    `stale_s` after the last renewal another coordinator may take the lease over."""

    __tablename__ = "coordinator_lease"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    holder: Mapped[str] = mapped_column(String(32))
    """A uuid4 hex drawn by each coordinator process at start."""
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    listen: Mapped[str] = mapped_column(String(255))
    stale_s: Mapped[float] = mapped_column(Float)
    acquired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


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


def hash_token(token: str) -> str:
    """Tokens are 256-bit random strings, so one SHA-256 is enough; only the hash is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    """Typed operations on the database; every write is one transaction."""

    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        """Open the database at `url`: an empty one is created at the newest schema revision, an older one is
        upgraded when `upgrade` (else SchemaError, as for one newer than this hydrafl)."""
        self.engine: Engine = create_engine(url)
        prepare_schema(self.engine, upgrade=upgrade)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self.sessions()

    def audit(
        self, kind: str, *, site_name: str = "", run_id: int | None = None, detail: str = ""
    ) -> None:
        with self.session() as session, session.begin():
            session.add(
                AuditEvent(kind=kind, site_name=site_name, run_id=run_id, detail=bounded(detail))
            )

    def add_site(self, name: str) -> tuple[Site, str]:
        """Enrol a site; returns it and its one-time token (shown once, stored only as a hash)."""
        token = secrets.token_urlsafe(32)
        with self.session() as session, session.begin():
            if session.scalar(select(Site).where(Site.name == name)) is not None:
                raise ValueError(
                    f"a site named {name!r} is already enrolled; revoke it or pick another name"
                )
            last = session.scalar(select(Site.node_id).order_by(Site.node_id.desc()).limit(1))
            site = Site(
                name=name, node_id=(last or FIRST_NODE_ID - 1) + 1, token_hash=hash_token(token)
            )
            session.add(site)
            session.add(AuditEvent(kind="enrolled", site_name=name))
        return site, token

    def sites(self) -> list[Site]:
        with self.session() as session:
            return list(session.scalars(select(Site).order_by(Site.node_id)))

    def revoke_site(self, name: str) -> None:
        with self.session() as session, session.begin():
            site = session.scalar(select(Site).where(Site.name == name))
            if site is None:
                raise ValueError(
                    f"no site named {name!r}; `hydrafl admin site list` shows the enrolled sites"
                )
            site.revoked = True
            session.add(AuditEvent(kind="revoked", site_name=name))

    def authenticate(self, token: str) -> Site | None:
        """The site holding `token`, or None when it is unknown or revoked."""
        digest = hash_token(token)
        with self.session() as session:
            site = session.scalar(select(Site).where(Site.token_hash == digest))
        if site is None or site.revoked or not hmac.compare_digest(site.token_hash, digest):
            return None
        return site

    def token_hashes(self) -> frozenset[str]:  # what `AuthThrottle` lets past its limit
        with self.session() as session:
            return frozenset(
                session.scalars(select(Site.token_hash).where(Site.revoked.is_(False)))
            )

    def audit_events(self, kind: str | None = None) -> list[AuditEvent]:
        with self.session() as session:
            query = select(AuditEvent).order_by(AuditEvent.id)
            if kind is not None:
                query = query.where(AuditEvent.kind == kind)
            return list(session.scalars(query))

    def create_run(self, config: dict, *, server_app: str | None = None) -> Run:
        """Queue a run of hydrafl's ServerApp with these run keys, or of the stock `server_app` with this run_config."""
        with self.session() as session, session.begin():
            run = Run(config=config, server_app=server_app)
            session.add(run)
        return run

    def runs(self) -> list[Run]:
        with self.session() as session:
            return list(session.scalars(select(Run).order_by(Run.id)))

    def run(self, run_id: int) -> Run:
        with self.session() as session:
            run = session.get(Run, run_id)
        if run is None:
            raise ValueError(f"no run {run_id}; `hydrafl admin run list` shows the runs")
        return run

    def run_status(self, run_id: int) -> str | None:
        """A run's status alone (sites ask it on every idle poll: the history is not read); None if no run."""
        with self.session() as session:
            return session.scalar(select(Run.status).where(Run.id == run_id))

    def next_run(self) -> Run | None:
        """The run to drive: one left running by a crashed coordinator first, else the oldest pending one."""
        with self.session() as session:
            for status in ("running", "pending"):
                run = session.scalar(
                    select(Run).where(Run.status == status).order_by(Run.id).limit(1)
                )
                if run is not None:
                    return run
        return None

    def set_run_status(
        self,
        run_id: int,
        status: str,
        *,
        detail: str = "",
        rounds_done: int | None = None,
        history: list | None = None,
    ) -> None:
        with self.session() as session, session.begin():
            run = session.get(Run, run_id)
            changed = run.status != status
            run.status = status
            run.detail = detail or run.detail
            if rounds_done is not None:
                run.rounds_done = rounds_done
            if history is not None:
                run.history = list(history)
            if status in ("finished", "failed"):
                run.finished_at = now()
            if changed:
                session.add(AuditEvent(kind=f"run-{status}", run_id=run_id, detail=bounded(detail)))

    def add_outbound(
        self, message_id: str, run_id: int, server_round: int, node_id: int, envelope: bytes
    ) -> None:
        self.add_outbounds(run_id, [(message_id, server_round, node_id, envelope)])

    def add_outbounds(self, run_id: int, messages: list[tuple[str, int, int, bytes]]) -> None:
        """Store a round's messages, (message id, round, node id, envelope) each, in one commit; a message
        re-sent under the id it had keeps its original row."""
        with self.session() as session, session.begin():
            for message_id, server_round, node_id, envelope in messages:
                if session.get(OutboundMessage, message_id) is None:
                    session.add(
                        OutboundMessage(
                            message_id=message_id,
                            run_id=run_id,
                            server_round=server_round,
                            node_id=node_id,
                            envelope=envelope,
                        )
                    )

    def close_messages(self, message_ids: list[str]) -> None:
        with self.session() as session, session.begin():
            for message in session.scalars(
                select(OutboundMessage).where(OutboundMessage.message_id.in_(message_ids))
            ):
                message.closed = True

    def outbound(self, message_id: str) -> OutboundMessage | None:
        with self.session() as session:
            return session.get(OutboundMessage, message_id)

    def next_message_for(self, node_id: int) -> OutboundMessage | None:
        """The oldest message to this site of a running run that it has not answered yet."""
        with self.session() as session:
            return session.scalar(_open_messages(node_id).limit(1))

    def open_messages_for(self, node_id: int) -> list[OutboundMessage]:
        """Every message this site may still answer (what it may download and upload for)."""
        with self.session() as session:
            return list(session.scalars(_open_messages(node_id)))

    def add_reply(
        self, outbound: OutboundMessage, envelope: bytes, *, event: AuditEvent | None = None
    ) -> bool:
        """Store a reply; False when this message was already answered (pushes are idempotent) or is gone: a
        sweep may delete it (its round is over) while the service checks the reply, and a reply must never
        outlive its message (SQLite does not enforce the foreign key). `event` is recorded with the reply, in
        its commit, exactly when the reply is stored."""
        try:
            with self.session() as session, session.begin():
                exists = session.scalar(
                    select(Reply.id).where(Reply.reply_to_message_id == outbound.message_id)
                )
                if exists is not None:
                    return False
                session.add(
                    Reply(
                        reply_to_message_id=outbound.message_id,
                        run_id=outbound.run_id,
                        server_round=outbound.server_round,
                        node_id=outbound.node_id,
                        envelope=envelope,
                    )
                )
                session.flush()  # the insert holds the write lock: a sweep commits before the check below, or after
                if session.get(OutboundMessage, outbound.message_id) is None:
                    raise LookupError(outbound.message_id)  # rolls the insert back
                if event is not None:
                    session.add(event)
        except (LookupError, IntegrityError):  # swept meanwhile, or answered by a concurrent push
            return False
        return True

    def replies_to(self, message_ids: list[str]) -> list[Reply]:
        with self.session() as session:
            return list(
                session.scalars(select(Reply).where(Reply.reply_to_message_id.in_(message_ids)))
            )

    def run_events(self, run_id: int, kinds: Collection[str]) -> list[AuditEvent]:
        """A run's audit events of these kinds, oldest first (e.g. the sites that declined its messages)."""
        with self.session() as session:
            query = select(AuditEvent).where(
                AuditEvent.run_id == run_id, AuditEvent.kind.in_(list(kinds))
            )
            return list(session.scalars(query.order_by(AuditEvent.id)))

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
            taken = swapped.rowcount == 1
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
            return renewed.rowcount == 1

    def release_lease(self, holder: str) -> None:
        """Give the lease up, so the next coordinator starts at once instead of waiting for it to go stale."""
        with self.session() as session, session.begin():
            session.execute(delete(CoordinatorLease).where(CoordinatorLease.holder == holder))


def _open_messages(node_id: int) -> Select:
    """Messages to this site of a running run, neither answered nor closed, oldest first."""
    answered = select(Reply.reply_to_message_id)
    running = select(Run.id).where(Run.status == "running")
    return (
        select(OutboundMessage)
        .where(OutboundMessage.node_id == node_id)
        .where(OutboundMessage.message_id.not_in(answered))
        .where(OutboundMessage.closed.is_(False))
        .where(OutboundMessage.run_id.in_(running))
        .order_by(OutboundMessage.created_at, OutboundMessage.message_id)
    )


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
