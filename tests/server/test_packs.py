"""A site's uploads in packs: one file per stream, found again by other processes' views of the folder, erased
chunk by chunk, a crash's partial pack never read, and chunk files of the earlier layout still served."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from hydrafl.proto.envelope import CHUNK_BYTES, UPLOADED, EnvelopeError
from hydrafl.server.blobs import BlobStore
from hydrafl.server.transport import pack_slots, packs
from hydrafl.server.transport.packs import SLOT_BYTES, UploadPacks, _StreamPack

WRITERS = ThreadPoolExecutor(4)


def chunks(count: int, seed: int = 0, size: int = CHUNK_BYTES) -> list[tuple[str, bytes]]:
    """`count` distinct chunks of float32 values; the last one shorter, as a tensor's last chunk is."""
    rng = np.random.default_rng(seed)
    pieces = [rng.random(size // 4, dtype=np.float32).tobytes() for _ in range(count)]
    pieces[-1] = pieces[-1][: size // 3 * 2 // 4 * 4 + 4]
    return [(UPLOADED.digest(piece), piece) for piece in pieces]


def namespace(folder: Path) -> UploadPacks:
    """A view of one site's namespace, as one process holds it."""
    return BlobStore(folder).uploads(7)


def pack_files(folder: Path, suffix: str = ".pack") -> list[Path]:
    return sorted((folder / "sites" / "7" / "packs").glob(f"*{suffix}"))


def test_a_stream_fills_one_pack_that_reads_back_exactly(tmp_path):
    uploads = namespace(tmp_path)
    items = chunks(5)
    assert uploads.put_stream(items) == (5, 0)
    [pack] = pack_files(tmp_path)
    assert pack.stat().st_size == 5 * SLOT_BYTES and pack_files(tmp_path, ".part") == []
    assert all(
        uploads.get(digest) == data and uploads.size(digest) == len(data) for digest, data in items
    )
    assert sorted(uploads.digests()) == sorted(digest for digest, _ in items)
    assert uploads.missing([digest for digest, _ in items]) == []
    assert all(uploads.finite_float32(digest) for digest, data in items if len(data) % 4 == 0)
    assert uploads.put_stream(items) == (0, 5)  # a resumed or repeated upload writes nothing again
    assert len(pack_files(tmp_path)) == 1


def test_a_chunk_reads_into_an_aligned_or_unaligned_buffer_of_its_size_alone(tmp_path):
    """Into page-aligned memory a whole-block chunk is read past the page cache, anything else through it: the
    same bytes either way; a buffer of another size is refused before anything is read."""
    uploads = namespace(tmp_path)
    items = chunks(3, seed=9)
    uploads.put_stream(items)
    memory = np.zeros(3 * CHUNK_BYTES + 4096 + 1, np.uint8)
    aligned = memory[-memory.ctypes.data % 4096 :]
    for offset in (0, 1):  # the first chunk aligned, then one byte off
        for index, (digest, data) in enumerate(items):
            start = index * CHUNK_BYTES
            out = aligned[offset + start : offset + start + len(data)]
            uploads.read_into(digest, out)
            assert out.tobytes() == data
    digest, data = items[0]
    with pytest.raises(EnvelopeError, match="holds"):
        uploads.read_into(digest, np.zeros(len(data) - 1, np.uint8))


def test_another_process_sees_new_packs_erasures_and_refreshed_write_times(tmp_path, monkeypatch):
    monkeypatch.setattr(packs, "TRUSTED_S", 0.0)  # every use reads the header, as after a minute
    writer, reader = namespace(tmp_path), BlobStore(tmp_path).uploads(7)
    first, second = chunks(3, seed=1), chunks(2, seed=2)
    writer.put_stream(first)
    assert reader.get(first[0][0]) == first[0][1]  # indexed from disk on first use
    writer.put_stream(second)
    assert reader.has(second[1][0])  # a pack written after the reader's first look
    before = reader.stat(first[1][0]).modified
    assert writer.put(*first[1]) is False  # a re-put refreshes the write time a sweep reads
    assert reader.stat(first[1][0]).modified > before
    reader.delete(first[0][0])  # a sweep in another process
    assert not writer.has(first[0][0]) and writer.missing([first[0][0]]) == [first[0][0]]
    assert (
        writer.put(*first[0]) is True and reader.get(first[0][0]) == first[0][1]
    )  # stored again, elsewhere


def test_a_pack_goes_with_its_last_chunk_and_erased_slots_free_their_blocks(tmp_path):
    uploads = namespace(tmp_path)
    items = chunks(4, seed=3)
    uploads.put_stream(items)
    [pack] = pack_files(tmp_path)
    blocks = pack.stat().st_blocks
    uploads.delete(items[0][0])
    assert not uploads.has(items[0][0]) and pack.stat().st_blocks < blocks
    assert sorted(uploads.digests()) == sorted(digest for digest, _ in items[1:])
    for digest, _ in items[1:]:
        uploads.delete(digest)
    assert pack_files(tmp_path) == [] and namespace(tmp_path).digests() == []


def test_a_bad_chunk_ends_the_stream_and_what_came_before_it_stays(tmp_path):
    uploads = namespace(tmp_path)
    items = chunks(6, seed=4)
    corrupt = items[:3] + [(items[3][0], b"not what the name says")] + items[4:]
    with pytest.raises(EnvelopeError, match=f"chunk {items[3][0][:12]} fails its XXH3-128 check"):
        uploads.put_stream(corrupt)
    assert all(uploads.has(digest) for digest, _ in items[:3]) and not uploads.has(items[3][0])
    assert pack_files(tmp_path, ".part") == []
    stored, present = uploads.put_stream(items)
    assert present >= 3 and stored + present == 6
    assert all(namespace(tmp_path).get(digest) == data for digest, data in items)


def test_a_crash_mid_stream_leaves_a_partial_that_is_never_read_and_is_swept(tmp_path):
    folder = tmp_path / "sites" / "7"
    crashed = _StreamPack(folder / "packs")
    buffer = pack_slots.slot_buffer()  # aligned, as O_DIRECT needs
    digest, data = chunks(1, seed=5)[0]
    buffer[: pack_slots.HEADER_FORMAT.size] = pack_slots.pack_header(
        pack_slots.Header(len(data), 0.0, digest)
    )
    crashed.write(
        memoryview(buffer), crashed.next_slot()
    )  # written, never sealed: the process died here
    uploads = namespace(tmp_path)
    assert not uploads.has(digest) and uploads.digests() == []
    assert uploads.partials() == [crashed.ref.path]


def test_writes_fall_back_to_the_page_cache_where_o_direct_is_refused(tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine to refuse O_DIRECT")
    folder = Path(os.path.join(shm, f"hydrafl-packs-{os.getpid()}"))
    try:
        uploads = namespace(folder)
        items = chunks(3, seed=6)
        assert uploads.put_stream(items) == (3, 0)
        assert all(namespace(folder).get(digest) == data for digest, data in items)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_chunk_files_of_the_earlier_layout_are_still_read_re_put_and_deleted(tmp_path):
    folder = tmp_path / "sites" / "7"
    old = BlobStore(folder, naming=UPLOADED, writers=WRITERS)
    (digest, data), fresh = chunks(1, seed=7)[0], chunks(2, seed=8)
    old.put(digest, data)
    uploads = namespace(tmp_path)
    uploads.put_stream(fresh)
    assert uploads.get(digest) == data and uploads.size(digest) == len(data) and uploads.has(digest)
    assert sorted(uploads.digests()) == sorted([digest] + [d for d, _ in fresh])
    assert uploads.put_stream([(digest, data)]) == (0, 1)  # present: not copied into a pack
    uploads.delete(digest)
    assert not old.has(digest) and not uploads.has(digest)
    with pytest.raises(KeyError):
        uploads.get(digest)
