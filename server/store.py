"""The coordinator's persistent state (SQLAlchemy): sites, runs, messages, replies, metrics, audit events, and
the lease that lets one coordinator at a time drive the runs of a database (`lease`). The schema: `tables`.

SQLite file by default, any SQLAlchemy URL (PostgreSQL) by `--db`. Array bytes are not here: envelopes
refer to chunks in the blob store by hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Collection

from sqlalchemy import Select, create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from hydrafl.bounded import bounded
from hydrafl.server.lease import LeaseRows
from hydrafl.server.migrations import prepare_schema
from hydrafl.server.tables import AdminToken, AuditEvent, OutboundMessage, Reply, Run, Site, now

FIRST_NODE_ID = 10_001


def hash_token(token: str) -> str:
    """Tokens are 256-bit random strings, so one SHA-256 is enough; only the hash is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


class Store(LeaseRows):
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

    def add_admin(self, name: str) -> str:
        """Create an administrator's token for the admin service; returns it (shown once, stored only as a hash)."""
        token = secrets.token_urlsafe(32)
        with self.session() as session, session.begin():
            if session.scalar(select(AdminToken).where(AdminToken.name == name)) is not None:
                raise ValueError(
                    f"an admin token named {name!r} exists; revoke it or pick another name"
                )
            session.add(AdminToken(name=name, token_hash=hash_token(token)))
            session.add(AuditEvent(kind="admin-token-created", detail=f"admin {name}"))
        return token

    def admins(self) -> list[AdminToken]:
        with self.session() as session:
            return list(session.scalars(select(AdminToken).order_by(AdminToken.id)))

    def revoke_admin(self, name: str) -> None:
        with self.session() as session, session.begin():
            admin = session.scalar(select(AdminToken).where(AdminToken.name == name))
            if admin is None:
                raise ValueError(
                    f"no admin token named {name!r}; `hydrafl admin token list` shows them"
                )
            admin.revoked = True
            session.add(AuditEvent(kind="admin-token-revoked", detail=f"admin {name}"))

    def authenticate_admin(self, token: str) -> AdminToken | None:
        """The administrator holding `token`, or None when it is unknown or revoked (a site's token is neither)."""
        digest = hash_token(token)
        with self.session() as session:
            admin = session.scalar(select(AdminToken).where(AdminToken.token_hash == digest))
        if admin is None or admin.revoked or not hmac.compare_digest(admin.token_hash, digest):
            return None
        return admin

    def admin_token_hashes(self) -> frozenset[str]:
        with self.session() as session:
            return frozenset(
                session.scalars(select(AdminToken.token_hash).where(AdminToken.revoked.is_(False)))
            )

    def audit_events(self, kind: str | None = None) -> list[AuditEvent]:
        with self.session() as session:
            query = select(AuditEvent).order_by(AuditEvent.id)
            if kind is not None:
                query = query.where(AuditEvent.kind == kind)
            return list(session.scalars(query))

    def create_run(
        self, config: dict, *, server_app: str | None = None, app_bundle: bytes | None = None
    ) -> Run:
        """Queue a run of hydrafl's ServerApp with these run keys, or of the stock `server_app` with this
        run_config (from `app_bundle`, a Flower app bundle, when given)."""
        with self.session() as session, session.begin():
            run = Run(config=config, server_app=server_app, app_bundle=app_bundle)
            session.add(run)
        return run

    def app_bundle(self, run_id: int) -> bytes | None:
        """The run's Flower app bundle (not loaded with the run: it may be megabytes)."""
        with self.session() as session:
            return session.scalar(select(Run.app_bundle).where(Run.id == run_id))

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
            if run is None:
                raise ValueError(f"no run {run_id}; `hydrafl admin run list` shows the runs")
            changed = run.status != status
            run.status = status
            run.detail = detail or run.detail
            if rounds_done is not None:
                run.rounds_done = rounds_done
            if history is not None:
                run.history = list(history)
            if status in ("finished", "failed", "stopped"):
                run.finished_at = now()
            if status != "running":
                run.stop_requested = ""
            if changed:
                session.add(AuditEvent(kind=f"run-{status}", run_id=run_id, detail=bounded(detail)))

    def request_stop(self, run_id: int, when: str) -> str:
        """Ask run `run_id` to stop (`tables.STOP_AT_ROUND_END` or `STOP_NOW`); returns its status after: a
        pending run is stopped at once, a running one when its driver sees the request."""
        with self.session() as session, session.begin():
            run = session.get(Run, run_id)
            if run is None:
                raise ValueError(f"no run {run_id}; `hydrafl admin run list` shows the runs")
            if run.status == "pending":
                run.status = "stopped"
                run.finished_at = now()
                session.add(
                    AuditEvent(kind="run-stopped", run_id=run_id, detail="before it started")
                )
            elif run.status == "running":
                run.stop_requested = when
            else:
                raise ValueError(
                    f"run {run_id} is {run.status}: only a pending or running run stops"
                )
            return run.status

    def stop_requested(self, run_id: int) -> str:
        """STOP_AT_ROUND_END or STOP_NOW when an administrator asked the run to stop; "" otherwise."""
        with self.session() as session:
            return session.scalar(select(Run.stop_requested).where(Run.id == run_id)) or ""

    def resume_run(self, run_id: int) -> None:
        """Queue a stopped run again: the coordinator continues it from its last checkpoint, as after a crash."""
        with self.session() as session, session.begin():
            run = session.get(Run, run_id)
            if run is None:
                raise ValueError(f"no run {run_id}; `hydrafl admin run list` shows the runs")
            if run.status != "stopped":
                raise ValueError(f"run {run_id} is {run.status}: only a stopped run resumes")
            run.status = "pending"
            run.finished_at = None
            session.add(AuditEvent(kind="run-resumed", run_id=run_id))

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
