"""Enrolment, tokens stored only as hashes, revocation, audit trail, and the content-addressed blob store."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from hydrafl.proto.envelope import SENT, EnvelopeError
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store, hash_token
from hydrafl.server.tables import Run, Site


@pytest.fixture
def store(db_url) -> Store:
    return Store(db_url)


def test_enrolment_token_authenticates_until_revoked(store, db_url):
    site, token = store.add_site("st-marys")
    other, other_token = store.add_site("royal-infirmary")
    assert other.node_id == site.node_id + 1 and token != other_token
    assert store.authenticate(token).name == "st-marys"
    assert store.authenticate("not-a-token") is None
    with store.session() as session:
        stored = session.scalar(select(Site).where(Site.name == "st-marys"))
    assert stored.token_hash == hash_token(token) and token not in stored.token_hash
    store.revoke_site("st-marys")
    assert store.authenticate(token) is None
    assert store.authenticate(other_token).name == "royal-infirmary"
    reopened = Store(db_url)  # state survives a restart
    assert [s.name for s in reopened.sites()] == ["st-marys", "royal-infirmary"]
    assert [e.kind for e in reopened.audit_events()] == ["enrolled", "enrolled", "revoked"]


def test_duplicate_and_unknown_site_names_are_clear_errors(store):
    store.add_site("a")
    with pytest.raises(ValueError, match="already enrolled"):
        store.add_site("a")
    with pytest.raises(ValueError, match="no site named 'b'"):
        store.revoke_site("b")


def test_blob_store_verifies_and_never_rewrites(tmp_path):
    blobs = BlobStore(tmp_path / "blobs")
    data = b"chunk of a pseudo-gradient"
    digest = SENT.digest(data)
    assert blobs.missing([digest]) == [digest]
    assert blobs.put(digest, data) is True
    assert blobs.put(digest, data) is False
    assert blobs.get(digest) == data and blobs.missing([digest]) == []
    with pytest.raises(EnvelopeError, match="fails its BLAKE3 check"):
        blobs.put(SENT.digest(b"other"), data)
    with pytest.raises(EnvelopeError, match="not a BLAKE3 hex digest"):
        blobs.has("../../etc/passwd")
    assert not (tmp_path / "blobs" / SENT.digest(b"other")[:2] / SENT.digest(b"other")).exists()


def test_blob_stream_stores_in_parallel_and_stops_at_a_bad_chunk(tmp_path):
    blobs = BlobStore(tmp_path / "blobs")
    pieces = [bytes([i]) * 5000 for i in range(40)]
    items = [(SENT.digest(piece), piece) for piece in pieces]
    assert blobs.put_stream(items[:10]) == (10, 0)
    corrupt = items[:25] + [(items[25][0], b"not what the name says")] + items[26:]
    with pytest.raises(EnvelopeError, match=f"chunk {items[25][0][:12]} fails its BLAKE3 check"):
        blobs.put_stream(corrupt)
    assert blobs.has(items[24][0]) and not blobs.has(items[25][0])
    assert list((tmp_path / "blobs").rglob("*.part")) == []  # no half-written blob is left behind
    stored, present = blobs.put_stream(
        items
    )  # the retry sends everything; only what is missing is written
    assert present >= 25 and stored + present == 40
    assert all(blobs.get(digest) == piece for digest, piece in items)


def test_runs_messages_and_idempotent_replies(store):
    run = store.create_run({"strategy": "fedavg", "rounds": 2})
    site, _ = store.add_site("a")
    store.set_run_status(run.id, "running")
    store.add_outbound("1-1-train-1", run.id, 1, site.node_id, b"envelope")
    store.add_outbound(
        "1-1-train-1", run.id, 1, site.node_id, b"other"
    )  # a re-send keeps the original
    outbound = store.next_message_for(site.node_id)
    assert outbound.message_id == "1-1-train-1" and outbound.envelope == b"envelope"
    assert store.add_reply(outbound, b"reply") is True
    assert store.add_reply(outbound, b"reply again") is False
    assert [r.envelope for r in store.replies_to(["1-1-train-1"])] == [b"reply"]
    assert store.next_message_for(site.node_id) is None
    store.set_run_status(run.id, "finished", rounds_done=2, history=[{"round": 0}])
    assert store.run(run.id).status == "finished" and store.run(run.id).history == [{"round": 0}]
    assert [e.kind for e in store.audit_events() if e.run_id == run.id] == [
        "run-running",
        "run-finished",
    ]
    assert isinstance(store.runs()[0], Run)
