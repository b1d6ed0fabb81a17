"""Secure aggregation of a model kept on disk (`secure_on_disk`): the masked sum in a file, each masked vector
added a window at a time from where its upload put it, the mean update unmasked and decoded a window at a time;
the same bits as the in-memory secure round, with sites dropping before or after masking too, and a coordinator
that never holds a whole masked vector."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import TIERED_RUN
from secagg_rounds import checked, sessions

from hydrafl import protocol
from hydrafl.client import site_app
from hydrafl.proto.envelope import CHUNK_BYTES, UPLOADED, EnvelopeError
from hydrafl.secagg import SecAggParams, ServerSession, decode_sum, encode, quantisation_bound
from hydrafl.secagg.field_sum import WINDOW_WORDS
from hydrafl.server import server_app
from hydrafl.server.aggregation import secure_round
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.aggregation.driver import RoundFailed
from hydrafl.server.aggregation.secure_on_disk import decode_mean, decode_sums, sum_file, words_of
from hydrafl.server.blobs import BlobStore
from hydrafl.server.transport.stored_replies import StoredArray
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid, _unavailable, _wire_copy
from hydrafl.strategies.by_tensor import RoundFiles
from hydrafl.tensor_files import MappedArray

NOT_NUMBERS = {"seconds", "aggregation_s", "gap_s", "secagg_s"}


@pytest.fixture
def seeded_sites(monkeypatch):
    """Every site's stochastic rounding drawn from one seed, so that two secure runs encode the same vectors
    (the masks differ from run to run, and cancel)."""
    unseeded = np.random.default_rng
    monkeypatch.setattr(
        np.random, "default_rng", lambda seed=None: unseeded(0 if seed is None else seed)
    )


class _DroppingGrid(InProcessGrid):
    """The in-process grid, with one site that stops answering at messages of one kind."""

    def __init__(self, *args, drop: tuple[int, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop = drop

    def _deliver(self, message):
        if (message.metadata.dst_node_id, message.metadata.message_type) == self.drop:
            return _wire_copy(_unavailable(message))
        return super()._deliver(message)


def _run(cfg, resident_model_bytes=None, drop=None):
    grid = _DroppingGrid(site_app.client_app, cfg.sites, cfg.to_flower(), drop=drop)
    return server_app.run_federation(grid, cfg, resident_model_bytes=resident_model_bytes)


def _numbers(history):
    return [{k: v for k, v in record.items() if k not in NOT_NUMBERS} for record in history]


def _same_bits(on_disk, in_memory, folder: Path) -> None:
    assert _numbers(on_disk.history) == _numbers(in_memory.history)
    for name, array in in_memory.arrays.items():
        kept = on_disk.arrays[name]
        assert isinstance(kept, MappedArray) and Path(kept.path).parent == folder
        np.testing.assert_array_equal(kept.numpy(), array.numpy())
    kinds = {path.name.split("-")[2] for path in folder.glob("round-*-*-*.safetensors")}
    assert kinds <= {"model", "momentum"}  # the masked sums and decoded means are gone


SUBNET = {"layer_score": "magnitude", "head_score": "magnitude"}
"""A secure run's subnetwork plan comes from the weights (no site's scores in the clear)."""


@pytest.mark.parametrize(
    "tiered, strategy, knobs",
    [
        (False, "diloco", {"outer_lr": 0.7, "outer_momentum": 0.9}),
        (False, "fedavg", {}),
        (False, "diloco", {"dp_clip": 0.05, "dp_noise_multiplier": 0.8}),  # distributed DP
        (True, "hydra", {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9, **SUBNET}),
        (True, "heterofl", SUBNET),
    ],
)
def test_a_secure_round_on_disk_ends_with_the_bits_of_the_in_memory_secure_round(
    small_run, tmp_path, seeded_sites, monkeypatch, tiered, strategy, knobs
):
    """The mean update (the FedAvg family, DiLoCo; with the sites' distributed-DP noise too) or the
    per-coordinate sums and weights (Hydra and the width baselines) decoded into files, stepped on tensor by
    tensor: two rounds, the second on momentum read back."""
    decoded = []
    for decode in ("decode_mean", "decode_sums"):
        original = getattr(secure_round, decode)
        monkeypatch.setattr(
            secure_round,
            decode,
            lambda *args, original=original, decode=decode: (
                decoded.append(decode) or original(*args)
            ),
        )
    base = TIERED_RUN.replace(run_dir=small_run.run_dir) if tiered else small_run
    cfg = base.replace(strategy=strategy, rounds=2, secagg=True, **knobs)
    in_memory = _run(cfg.replace(run_dir=str(tmp_path / "memory")))
    assert not decoded
    on_disk = _run(cfg.replace(run_dir=str(tmp_path / "disk")), resident_model_bytes=0)
    assert decoded == ["decode_sums" if tiered else "decode_mean"] * 2  # each round's, into files
    _same_bits(on_disk, in_memory, tmp_path / "disk")
    assert [r["sites_ok"] for r in on_disk.history[1:]] == [3, 3]


@pytest.mark.parametrize(
    "kind, sites_ok",
    [
        ("train", 2),  # dropped after sharing keys, before masking: its pairwise masks are rebuilt
        (protocol.QUERY_SECAGG_CHECK, 3),  # dropped after masking: its self-mask is rebuilt
    ],
)
def test_a_site_dropping_before_or_after_masking_is_unmasked_on_disk_as_in_memory(
    small_run, tmp_path, seeded_sites, kind, sites_ok
):
    cfg = small_run.replace(strategy="diloco", rounds=1, secagg=True)
    drop = (FIRST_NODE_ID + 1, kind)
    in_memory = _run(cfg.replace(run_dir=str(tmp_path / "memory")), drop=drop)
    on_disk = _run(cfg.replace(run_dir=str(tmp_path / "disk")), 0, drop)
    assert on_disk.history[1]["sites_ok"] == sites_ok
    _same_bits(on_disk, in_memory, tmp_path / "disk")


def test_secure_sums_a_strategy_steps_on_only_in_memory_are_refused_before_any_round(tmp_path):
    cfg = TIERED_RUN.replace(
        strategy="fedit", rounds=1, secagg=True, lora_rank=8, run_dir=str(tmp_path), **SUBNET
    )
    with pytest.raises(
        RoundFailed, match="resident-model-mb.*FedIT's per-coordinate sums in memory"
    ):
        _run(cfg, resident_model_bytes=0)
    assert load_checkpoint(tmp_path) is None


def _stored(tmp_path: Path, node: int, vector: np.ndarray) -> StoredArray:
    """`vector` as the coordinator holds a large upload: 1 MiB chunks in the site's upload packs."""
    uploads = BlobStore(tmp_path / "blobs").uploads(node)
    raw = vector.view(np.uint8)
    pieces = [
        raw[start : start + CHUNK_BYTES].tobytes() for start in range(0, raw.size, CHUNK_BYTES)
    ]
    digests = [UPLOADED.digest(piece) for piece in pieces]
    uploads.put_stream(zip(digests, pieces, strict=True))
    return StoredArray(uploads, digests, "uint32", vector.shape)


@pytest.mark.parametrize("per_coordinate", [False, True])
def test_the_coordinator_sums_and_decodes_a_32_mb_update_in_a_window_of_a_few_mb(
    tmp_path, per_coordinate
):
    """Three sites' masked vectors of 8M words (a 32 MB float32 update; a subnetwork's: 4M weights, 4M values),
    stored as uploads are: the coordinator's peak of traced allocations while it sums, unmasks and decodes them
    is a few 1 MiB windows, and the decoded mean (sums and weights) is the in-memory decode's, within the
    quantisation bound of the plain one."""
    nodes, params = [1, 2, 3], SecAggParams()
    size = (4 if per_coordinate else 8) << 20
    length = 2 * size if per_coordinate else 1 + size
    shapes = {"w": (1024, 4095), "b": (size - 1024 * 4095,)}
    model = ArrayRecord(
        {name: Array(np.zeros(shape, np.float32)) for name, shape in shapes.items()}
    )
    rng = np.random.default_rng(0)
    deltas = {node: rng.normal(0, 0.01, size) for node in nodes}
    weights = {1: 20, 2: 300, 3: 45}
    covered = {node: np.arange(size) % node == 0 for node in nodes}  # a subnetwork's coordinates
    sites = sessions(nodes, params)
    files = RoundFiles(tmp_path, 1)
    with sum_file(files, length) as total:
        server = ServerSession.start(1, nodes, params, length, total)
        for node, site in sites.items():
            server.receive_keys(node, site.public_keys())
        for node, site in sites.items():
            server.receive_shares(node, site.share_keys(server.keys_for(node)))
        stored = {}
        for node in nodes:
            weight = covered[node] * weights[node] if per_coordinate else weights[node]
            encoded = encode(deltas[node] * covered[node], weight, params, rng)
            stored[node] = _stored(
                tmp_path, node, sites[node].mask(encoded, server.shares_for(node))
            )
        del encoded
        tracemalloc.start()
        for node in nodes:
            server.receive_masked(node, words_of(stored[node]))
        checked(server, sites)
        survivors, signatures = server.unmask_request()
        for node in signatures:
            server.receive_unmask(node, sites[node].unmask(survivors, signatures))
        unmasked, count = server.unmasked()
        decode = decode_sums if per_coordinate else decode_mean
        content, largest = decode(unmasked, count, params, model, list(shapes), files)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # a few windows (the sum's, a mask's, the decode's float64), not one of the 32 MB vectors
        assert peak < 8 * 4 * WINDOW_WORDS <= 4 * length / 4, f"{peak / 2**20:.1f} MiB at the peak"
        whole = unmasked.read(0, length)
    summed_weights, weighted = decode_sum(whole, count, params, per_coordinate=per_coordinate)
    flat = {
        key: np.concatenate([record[name].numpy().ravel() for name in shapes])
        for key, record in content.items()
    }
    plain = sum(weights[node] * deltas[node] * covered[node] for node in nodes)
    bound = quantisation_bound(3, params)
    if per_coordinate:
        assert largest == sum(weights.values()) == summed_weights.max()  # node 1 covers all
        np.testing.assert_array_equal(flat["weights"], summed_weights.astype(np.float32))
        np.testing.assert_array_equal(flat["sums"], weighted.astype(np.float32))
        assert np.abs(flat["sums"] - plain).max() <= bound + 1e-6
    else:
        assert largest == summed_weights[0] == sum(weights.values())
        np.testing.assert_array_equal(
            flat["arrays"], (weighted / summed_weights[0]).astype(np.float32)
        )
        assert np.abs(flat["arrays"] - plain / largest).max() <= bound / largest + 1e-7
    kinds = sorted(path.name.split("-")[2] for path in tmp_path.glob("round-*"))
    assert kinds == (["secured", "secweights"] if per_coordinate else ["secured"])


def test_a_stored_upload_reads_any_window_from_the_chunks_that_hold_it(tmp_path):
    vector = np.random.default_rng(2).integers(0, 2**32, 3 * CHUNK_BYTES // 4 + 5, np.uint32)
    stored, raw = _stored(tmp_path, 1, vector), vector.tobytes()
    windows = [(0, len(raw)), (5, 0), (CHUNK_BYTES - 3, 10), (CHUNK_BYTES, CHUNK_BYTES)]
    for start, count in [*windows, (len(raw) - 7, 7), (1, 2 * CHUNK_BYTES + 3)]:
        assert stored.read_bytes(start, count) == raw[start : start + count]
    with pytest.raises(EnvelopeError, match="outside"):
        stored.read_bytes(len(raw) - 1, 2)
    across = CHUNK_BYTES // 4 - 1  # a window of words across two chunks
    np.testing.assert_array_equal(words_of(stored)(across, 3), vector[across : across + 3])
