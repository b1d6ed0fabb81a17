"""The coordinator's database schema (SQLAlchemy): sites, runs, the messages sent to sites and their replies,
audit events, and the coordinator lease's one row. Migrations: `migrations/`; operations: `store.Store`."""

from __future__ import annotations

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
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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


class AdminToken(Base):
    """An administrator's credential for the coordinator's admin service: a hash of its token, never a site's."""

    __tablename__ = "admin_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)


STOP_AT_ROUND_END = "round"
STOP_NOW = "now"

STOCK_ROUNDS_KEY = "num-server-rounds"


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    config: Mapped[dict] = mapped_column(JSON)
    """hydrafl's run keys; for a stock Flower ServerApp, its typed run_config (`--run-config`)."""
    server_app: Mapped[str | None] = mapped_column(String(255), nullable=True)
    """A stock Flower ServerApp's module:attribute reference, or None for a run of hydrafl's own ServerApp."""
    status: Mapped[str] = mapped_column(String(16), default="pending")
    """pending -> running -> finished | failed | stopped (an administrator stopped it; resumable)"""
    rounds_done: Mapped[int] = mapped_column(Integer, default=0)
    history: Mapped[list] = mapped_column(JSON, default=list)
    """Per-round records (loss, accuracy, bytes, timings), as in the simulation's results.json."""
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    app_bundle: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, deferred=True)
    """A stock app run's Flower app bundle (`hydrafl.app_bundle`), shipped to its sites; None otherwise."""
    stop_requested: Mapped[str] = mapped_column(String(8), default="", server_default="")
    """STOP_AT_ROUND_END or STOP_NOW while an administrator's stop waits for the driver; "" otherwise."""

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
    lease-taken-over, run-stopped, admin-* (an administrator's action: `administration`)"""
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
