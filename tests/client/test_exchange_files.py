"""A site whose exchange memory is smaller than the message downloads it into a file and uploads its reply from
one (`--exchange-memory-mb`): the arrays arrive bit for bit as they do in memory, a dropped download resumes in
its file, the files go when the message is done, and the site's memory grows by far less than the model."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from fake_coordinator import FakeCoordinator, coordinator_message, serve_in_thread
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from helpers import SMALL_RUN, started_coordinator_run

from hydrafl.benchmarks import _large_site
from hydrafl.client import exchange_folder, site_app
from hydrafl.client.agent import SiteAgent
from hydrafl.client.site_pipeline import answer
from hydrafl.client.site_policy import SitePolicy
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import join_message
from hydrafl.tensor_files import (
    MappedArray,
    TensorFileError,
    TensorFileWriter,
    as_record,
    removed_when_unused,
    save_tensors,
)

FILE_BOUND = 1_000_000
"""Exchange memory below the test message (4.9 MB): it goes through files."""
app = ClientApp()
seen: list[dict[str, type]] = []


@app.query("echo")
def _echo(message: Message, context: Context) -> Message:
    """The arrays as received, sent back: a file-backed download is uploaded from its own file."""
    record = message.content["arrays"]
    seen.append({name: type(array) for name, array in record.items()})
    return Message(RecordDict({"arrays": record}), reply_to=message)


@app.query("double")
def _double(message: Message, context: Context) -> Message:
    """New arrays in memory: over the bound, the site writes them to a file before uploading."""
    record = message.content["arrays"]
    doubled = {name: Array(array.numpy() * 2) for name, array in record.items()}
    return Message(
        RecordDict({"arrays": ArrayRecord(doubled), "metrics": MetricRecord({"n": 1})}),
        reply_to=message,
    )


@app.query("written")
def _written(message: Message, context: Context) -> Message:
    """Its reply written to a file of its own, which goes once the site has sent the reply."""
    record = message.content["arrays"]
    path = Path(str(message.content["config"]["folder"])) / "reply.safetensors"
    doubled = {name: array.numpy() * 2 for name, array in record.items()}
    return Message(
        RecordDict({"arrays": as_record(removed_when_unused(save_tensors(path, doubled)))}),
        reply_to=message,
    )


def model() -> dict[str, np.ndarray]:
    """4.9 MB in five tensors: one over two chunks, two equal ones (a chunk listed twice), an int64 and an
    empty one."""
    rng = np.random.default_rng(3)
    zeros = np.zeros(400_000, np.float32)
    return {
        "a": rng.normal(size=(600, 700)).astype(np.float32),
        "z1": zeros,
        "z2": zeros.copy(),
        "i": np.arange(1000, dtype=np.int64),
        "e": np.empty((0, 4), np.float32),
    }


@pytest.fixture
def no_mapped_data(monkeypatch):
    """A MappedArray's serialised bytes would be the whole tensor in memory: no site code may ask for them."""

    def refused(self):
        raise AssertionError("MappedArray.data read")

    monkeypatch.setattr(MappedArray, "data", property(refused))


@contextlib.contextmanager
def serving(address: str, token: str, **options) -> Iterator[SiteAgent]:
    stop = threading.Event()
    agent = SiteAgent(address, token, app, {}, **options)
    thread, raised = serve_in_thread(agent.run, stop)
    try:
        yield agent
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not raised, raised


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("bound", [FILE_BOUND, None], ids=["file", "memory"])
def test_a_download_and_its_reply_arrive_bit_for_bit_through_files_or_memory(
    tmp_path, monkeypatch, no_mapped_data, bound
):
    spilled: list[Path] = []
    beside: list[list[str]] = []

    def spy(reply: Message, path: Path) -> None:
        spilled.append(path)
        beside.append(sorted(p.name for p in path.parent.iterdir()))
        file_backed(reply, path)

    file_backed = exchange_folder.file_backed
    monkeypatch.setattr(exchange_folder, "file_backed", spy)
    coordinator, grid, [(node, token)] = started_coordinator_run(tmp_path, "a")
    exchange = tmp_path / "exchange"
    exchange.mkdir()
    options = {"exchange_dir": exchange} | ({"exchange_memory_bytes": bound} if bound else {})
    values = model()
    seen.clear()
    try:
        with serving(f"127.0.0.1:{coordinator.port}", token, inline_bytes=0, **options):
            replies = {}
            for kind in ("echo", "double"):
                request = Message(
                    RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in values.items()})}),
                    dst_node_id=node.node_id,
                    message_type=f"query.{kind}",
                )
                request.metadata.group_id = "1"
                [message_id] = grid.push_messages([request])
                wait_for(lambda: bool(grid.store.replies_to([message_id])))  # noqa: B023
                [replies[kind]] = grid.pull_messages([message_id])
                wait_for(lambda: not list(exchange.iterdir()))  # the message is done: its files go
    finally:
        coordinator.stop()
    expected = MappedArray if bound else Array
    assert seen == [dict.fromkeys(values, expected)]
    for kind, factor in (("echo", 1), ("double", 2)):
        assert not replies[kind].has_error(), replies[kind].error
        record = replies[kind].content["arrays"]
        assert list(record) == list(values)
        for name, value in values.items():
            got = record[name].numpy()
            assert got.dtype == value.dtype and got.shape == value.shape
            assert got.tobytes() == (value * factor).astype(value.dtype).tobytes(), name
    assert [path.parent for path in spilled] == ([exchange] if bound else [])
    # "double" answered with new arrays: its download went before the upload was written (one model on disk,
    # not two); "echo" uploaded from its download, which therefore stayed until the reply was pushed
    assert beside == ([[]] if bound else [])


def test_a_reply_the_app_wrote_to_a_file_is_uploaded_from_it_and_the_file_goes_once_sent(tmp_path):
    """Without the cycle collector: Flower's records refer to themselves, and a site process waiting for its
    next message may not run a full collection for minutes, so the sent reply must go by reference counts."""
    gc.disable()
    try:
        _the_written_reply_goes(tmp_path)
    finally:
        gc.enable()


def _the_written_reply_goes(tmp_path: Path) -> None:
    coordinator, grid, [(node, token)] = started_coordinator_run(tmp_path, "a")
    folder = tmp_path / "app"
    folder.mkdir()
    values = {"a": model()["a"]}
    try:
        with serving(f"127.0.0.1:{coordinator.port}", token, inline_bytes=0):
            request = Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({"a": Array(values["a"])}),
                        "config": ConfigRecord({"folder": str(folder)}),
                    }
                ),
                dst_node_id=node.node_id,
                message_type="query.written",
            )
            request.metadata.group_id = "1"
            [message_id] = grid.push_messages([request])
            wait_for(lambda: bool(grid.store.replies_to([message_id])))
            [reply] = grid.pull_messages([message_id])
            wait_for(
                lambda: not list(folder.iterdir())
            )  # sent: the site let go of it, the file went
    finally:
        coordinator.stop()
    assert reply.content["arrays"]["a"].numpy().tobytes() == (values["a"] * 2).tobytes()


class _DroppingDownload(FakeCoordinator):
    """Drops the first chunk stream after two chunks, as a lost connection does, and hands the message out again;
    notes the site's exchange folder when it comes back for the rest."""

    exchange: Path | None = None
    files_at_resume: list[str] | None = None

    def GetChunks(
        self, request: pb.GetChunksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Chunk]:
        self.chunk_requests.append(list(request.digests))
        if len(self.chunk_requests) == 2 and self.exchange is not None:
            self.files_at_resume = sorted(path.name for path in self.exchange.iterdir())
        for index, digest in enumerate(request.digests):
            if index == 2 and len(self.chunk_requests) == 1:
                # handed out again, as the coordinator re-sends the message in hand
                self.outbox.put(self.in_hand)
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped")
            yield pb.Chunk(digest=digest, data=self.blobs[digest])


def test_a_file_backed_download_cut_short_resumes_in_its_file_and_the_file_goes(
    tmp_path, no_mapped_data
):
    values = model()
    message = coordinator_message("query.echo", values)
    coordinator = _DroppingDownload()
    coordinator.exchange = tmp_path / "exchange"
    coordinator.exchange.mkdir()
    server = coordinator.start()
    seen.clear()
    try:
        with serving(
            coordinator.address,
            "token",
            exchange_memory_bytes=FILE_BOUND,
            exchange_dir=coordinator.exchange,
        ) as agent:
            message_id = coordinator.send(message)
            reply = coordinator.reply_to(message_id, lambda: True)
            wait_for(lambda: not list(coordinator.exchange.iterdir()))
            assert agent.received.file is None
    finally:
        server.stop(grace=None)
    first, again = coordinator.chunk_requests
    assert again == first[2:]  # only what the dropped stream had not brought
    assert coordinator.files_at_resume == [f"download-{message_id}.safetensors"]
    assert seen == [dict.fromkeys(values, MappedArray)]
    arrays = join_message(reply, coordinator.blobs).content["arrays"]
    assert all(arrays[k].numpy().tobytes() == v.tobytes() for k, v in values.items())


def _vm_hwm(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) << 10
    )


@pytest.mark.slow
def test_a_site_s_memory_grows_by_far_less_than_the_model_it_exchanges(tmp_path):
    """A 256 MiB model down and a 256 MiB pseudo-gradient up, through `hydrafl site` with 16 MB of exchange
    memory: the site process's peak resident memory grows by under a quarter of the model (a window of chunks
    and gRPC's buffers, whatever the model's size: `benchmarks/site_exchange.py`; in memory it grows by 2.4
    models)."""
    layers, width = 4, 4096
    coordinator, grid, [(node, token)] = started_coordinator_run(tmp_path, "big")
    (tmp_path / "token").write_text(token)
    site = subprocess.Popen(
        [sys.executable, "-m", "hydrafl", "site", "--coordinator", f"127.0.0.1:{coordinator.port}"]
        + ["--token-file", str(tmp_path / "token"), "--state-dir", str(tmp_path / "state")]
        + ["--app", "hydrafl.benchmarks._large_site:app", "--exchange-memory-mb", "16"]
        + ["--node-config", "large-layers=1 large-width=8"],
        env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )

    def train(start: dict[str, np.ndarray]) -> Message:
        request = Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in start.items()}),
                    "config": ConfigRecord({"server-round": 1}),
                }
            ),
            dst_node_id=node.node_id,
            message_type="train",
        )
        request.metadata.group_id = "1"
        [message_id] = grid.push_messages([request])
        wait_for(lambda: bool(grid.store.replies_to([message_id])), timeout_s=120)
        [reply] = grid.pull_messages([message_id])
        assert not reply.has_error(), reply.error
        return reply

    try:
        train(
            {"warm": np.ones((8, 8), np.float32)}
        )  # imports and first-use buffers, before the baseline
        Path(f"/proc/{site.pid}/clear_refs").write_text("5")  # its peak := its resident memory now
        before = _vm_hwm(site.pid)
        start = {
            name: _large_site.initial_values(name, slice(0, width), width)
            for name in _large_site.large_layout(layers, width)
        }
        reply = train(start)
        after = _vm_hwm(site.pid)
    finally:
        site.send_signal(2)
        site.wait(timeout=30)
        coordinator.stop()
    model_bytes = layers * width * width * 4
    assert after - before < model_bytes / 4, (after - before) / 2**20  # a window: ~35 MiB here
    record = reply.content["arrays"]
    for index, (name, values) in enumerate(start.items()):
        expected = np.concatenate(
            [
                _large_site.pseudo_gradient(values[rows], (1, node.node_id, index, rows.start))
                for rows in _large_site.row_blocks(width, width * 4)
            ]
        )
        assert record[name].numpy().tobytes() == expected.tobytes(), name
    assert reply.content["metrics"]["num-examples"] == 1
    assert not list((tmp_path / "state" / "exchange").iterdir())
    assert not list(tmp_path.glob("large-reply-*"))


def test_hydrafl_s_own_app_trains_from_a_file_backed_download_to_the_same_delta(
    tmp_path, no_mapped_data
):
    """The ClientApp every hydrafl site runs reads MappedArrays as it reads Arrays in memory, and none of it asks
    for their serialised bytes."""
    cfg = SMALL_RUN.replace(sites=2, samples_per_site=50, local_steps=3, batch_size=8)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1

    def context() -> Context:
        node_config = {"partition-id": 1, "num-partitions": 2}
        return Context(1, 5, node_config, RecordDict(), cfg.to_flower())

    query = Message(RecordDict(), dst_node_id=5, message_type="query.init")
    initial = site_app.initial_model(query, context()).content["arrays"]
    mapped = as_record(save_tensors(tmp_path / "model.safetensors", dict(initial.items())))
    deltas = []
    for record in (initial, mapped):
        content = {"arrays": record, "config": ConfigRecord({"server-round": 2})}
        message = Message(RecordDict(content), dst_node_id=5, message_type="train")
        reply = answer(site_app.client_app, message, context(), SitePolicy())
        assert not reply.has_error(), reply.error
        deltas.append(reply.content["arrays"])
    assert all(isinstance(array, MappedArray) for array in mapped.values())
    assert list(deltas[0]) == list(deltas[1]) and len(deltas[0]) > 10
    assert all(deltas[0][k].numpy().tobytes() == deltas[1][k].numpy().tobytes() for k in deltas[0])


def test_a_tensor_file_is_filled_piece_by_piece_and_read_back_a_window_at_a_time(tmp_path):
    """What the site's files rest on (`TensorFileWriter.write_at`, `MappedArray.read_bytes`, `discard`)."""
    values = np.arange(1000, dtype=np.float32).reshape(100, 10)
    layout = {"w": ("float32", (100, 10)), "empty": ("float32", (0, 3))}
    writer = TensorFileWriter(tmp_path / "t.safetensors", layout)
    raw = values.tobytes()
    for start in (2000, 0, 3000, 1000):  # any order; the empty tensor needs no write
        writer.write_at("w", start, raw[start : start + 1000])
    with pytest.raises(TensorFileError, match="outside its 4000 bytes"):
        writer.write_at("w", 3500, raw[:1000])
    mapped = writer.close(durable=False)
    assert mapped["w"].numpy().tobytes() == raw and mapped["empty"].shape == (0, 3)
    assert mapped["w"].read_bytes(40, 80) == raw[40:120]
    with pytest.raises(TensorFileError, match="outside the tensor"):
        mapped["w"].read_bytes(3990, 20)
    unfinished = TensorFileWriter(tmp_path / "u.safetensors", layout)
    unfinished.write_at("w", 0, raw[:100])
    with pytest.raises(TensorFileError, match="never written"):
        TensorFileWriter(tmp_path / "v.safetensors", layout).close()
    unfinished.discard()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["t.safetensors", "v.safetensors"]
