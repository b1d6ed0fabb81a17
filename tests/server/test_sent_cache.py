"""The coordinator's sent chunks in memory: newest kept within the bound, served without their files, and the
files still serve what the cache does not hold."""

from __future__ import annotations

import os

import pytest

from hydrafl.proto.chunk_wire import decode_chunk, encode_chunk
from hydrafl.proto.envelope import SENT
from hydrafl.server.blobs import BlobStore
from hydrafl.server.transport.sent_cache import SentCache


def _chunks(count: int, size: int = 1000) -> list[tuple[str, bytes]]:
    pieces = [bytes([index]) * size for index in range(count)]
    return [(SENT.digest(piece), piece) for piece in pieces]


def test_the_newest_chunks_stay_within_the_bound_and_a_chunk_sent_again_is_newest():
    chunks = _chunks(4)
    one = len(encode_chunk(chunks[0]))
    cache = SentCache(3 * one)
    for digest, data in chunks[:3]:
        cache.add(digest, data)
    cache.add(*chunks[0])  # sent again (the next round's model shares it): now the newest
    cache.add(*chunks[3])
    assert cache.get(chunks[1][0]) is None  # the oldest went
    assert [cache.get(digest) for digest, _ in (chunks[0], chunks[2], chunks[3])] == [
        encode_chunk(chunk) for chunk in (chunks[0], chunks[2], chunks[3])
    ]
    assert cache.nbytes == 3 * one
    cache.discard(chunks[2][0])
    assert cache.get(chunks[2][0]) is None and cache.nbytes == 2 * one
    big = bytes(3 * one)
    cache.add(SENT.digest(big), big)  # larger than the whole cache: never held
    assert cache.get(SENT.digest(big)) is None and cache.nbytes == 2 * one


def test_a_stored_model_is_served_from_memory_and_from_its_files_after_a_restart(tmp_path):
    chunks = _chunks(5)
    store = BlobStore(tmp_path, cache=SentCache(1 << 20))
    assert store.put_stream(chunks) == (5, 0)
    store.sync()
    moved = {digest: store.root / digest[:2] / digest for digest, _ in chunks}
    for path in moved.values():
        os.rename(path, path.with_suffix(".aside"))
    for digest, data in chunks:  # no file read: the cache holds every chunk the push stored
        assert decode_chunk(store.wire(digest)).data == data
    for path in moved.values():
        os.rename(path.with_suffix(".aside"), path)
    restarted = BlobStore(tmp_path, cache=SentCache(1 << 20))
    assert all(restarted.wire(digest) == encode_chunk((digest, data)) for digest, data in chunks)
    assert restarted.cache.nbytes == 0  # a read does not fill the cache
    store.delete(chunks[0][0])  # a sweep: gone from the files and the cache
    with pytest.raises(KeyError, match="is not stored"):
        store.wire(chunks[0][0])
    assert store.cache.nbytes == 4 * len(store.wire(chunks[1][0]))
