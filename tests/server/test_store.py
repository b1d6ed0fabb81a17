"""Enrolment, tokens stored only as hashes, revocation, audit trail, and the content-addressed blob store."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from hydrafl.proto.envelope import EnvelopeError, sha256
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Site, Store, hash_token


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'coordinator.db'}")


def test_enrolment_token_authenticates_until_revoked(store, tmp_path):
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
    reopened = Store(f"sqlite:///{tmp_path / 'coordinator.db'}")  # state survives a restart
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
    digest = sha256(data)
    assert blobs.missing([digest]) == [digest]
    assert blobs.put(digest, data) is True
    assert blobs.put(digest, data) is False
    assert blobs.get(digest) == data and blobs.missing([digest]) == []
    with pytest.raises(EnvelopeError, match="fails its SHA-256"):
        blobs.put(sha256(b"other"), data)
    with pytest.raises(EnvelopeError, match="not a SHA-256"):
        blobs.has("../../etc/passwd")
    assert not (tmp_path / "blobs" / sha256(b"other")[:2] / sha256(b"other")).exists()
