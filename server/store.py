"""The coordinator's persistent state (SQLAlchemy): sites, runs, messages, replies, metrics, audit events.

SQLite file by default, any SQLAlchemy URL (PostgreSQL) by `--db`. Array bytes are not here: envelopes
refer to chunks in the blob store by hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    select,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

FIRST_NODE_ID = 10_001


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


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    config: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    """pending -> running -> finished | failed"""
    rounds_done: Mapped[int] = mapped_column(Integer, default=0)
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class OutboundMessage(Base):
    """A message the coordinator addressed to a site (an assignment)."""

    __tablename__ = "messages"
    message_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    server_round: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[int] = mapped_column(BigInteger, index=True)
    envelope: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


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
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    kind: Mapped[str] = mapped_column(String(32))
    """enrolled, revoked, update-accepted, update-rejected, run-started, run-finished, run-failed"""
    site_name: Mapped[str] = mapped_column(String(128), default="")
    run_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")


def hash_token(token: str) -> str:
    """Tokens are 256-bit random strings, so one SHA-256 is enough; only the hash is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    """Typed operations on the database; every write is one transaction."""

    def __init__(self, url: str) -> None:
        self.engine: Engine = create_engine(url)
        Base.metadata.create_all(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self.sessions()

    def audit(self, kind: str, *, site_name: str = "", run_id: int | None = None, detail: str = "") -> None:
        with self.session() as session, session.begin():
            session.add(AuditEvent(kind=kind, site_name=site_name, run_id=run_id, detail=detail))

    def add_site(self, name: str) -> tuple[Site, str]:
        """Enrol a site; returns it and its one-time token (shown once, stored only as a hash)."""
        token = secrets.token_urlsafe(32)
        with self.session() as session, session.begin():
            if session.scalar(select(Site).where(Site.name == name)) is not None:
                raise ValueError(f"a site named {name!r} is already enrolled; revoke it or pick another name")
            last = session.scalar(select(Site.node_id).order_by(Site.node_id.desc()).limit(1))
            site = Site(name=name, node_id=(last or FIRST_NODE_ID - 1) + 1, token_hash=hash_token(token))
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
                raise ValueError(f"no site named {name!r}; `hydrafl admin site list` shows the enrolled sites")
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

    def audit_events(self, kind: str | None = None) -> list[AuditEvent]:
        with self.session() as session:
            query = select(AuditEvent).order_by(AuditEvent.id)
            if kind is not None:
                query = query.where(AuditEvent.kind == kind)
            return list(session.scalars(query))
