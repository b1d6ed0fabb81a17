"""A site of a model larger than its memory, for the benchmarks of issue 33: a ClientApp that never holds the
model, only a block of rows of one tensor at a time.

Its model is a stack of `large-layers` square float32 linear layers of `large-width` (node_config first, else the
run config). `query.init` answers with that model, generated block by block into a safetensors file; `train`
answers with a deterministic pseudo-gradient computed block by block from the model it was sent (a MappedArray
when the site's download went to a file): delta = 0.01 * start + 0.001 * noise seeded by (round, node, tensor).
Its replies are MappedArrays over its own file, which the site agent uploads from a chunk at a time; the file
goes once the site has sent the reply (`removed_when_unused`). With `large-turns` (node_config: a lock file the
sites share) the sites of one machine write and send their replies in turn: each holds the lock from the moment it
starts a reply until that reply's file is gone, so one disk holds one reply at a time. With `large-in-memory`
(node_config) it replies with
Arrays in memory instead, as an ordinary ClientApp does: the baseline of `benchmarks/site_exchange.py`. Its
metrics are what a DiLoCo round reads: the reply's weight (`large-examples`, default 1), trainable parameters
and a train loss.
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from hydrafl import protocol
from hydrafl.arrays import array_view
from hydrafl.run_settings import message_keys
from hydrafl.tensor_files import MappedArray, TensorFileWriter, as_record, removed_when_unused

BLOCK_BYTES = 4 << 20
"""Rows computed at once: about this many bytes of a tensor."""
OUTER_SCALE, NOISE_SCALE = 0.01, 0.001

app = ClientApp()


def large_layout(layers: int, width: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The model's tensors: `layers` square float32 matrices of `width`."""
    return {f"layer{index}.weight": ("float32", (width, width)) for index in range(layers)}


def initial_values(name: str, rows: slice, width: int) -> np.ndarray:
    """Rows `rows` of tensor `name`'s initial values, the same whoever computes them (a test, a benchmark): a
    ramp, cheap to generate at gigabytes a second, since the benchmarks measure the exchange, not a generator."""
    index = int(name.removeprefix("layer").removesuffix(".weight"))
    offsets = np.arange(rows.start, rows.stop, dtype=np.float32) * np.float32(1e-4) + np.float32(
        index
    )
    return np.arange(width, dtype=np.float32)[None, :] * np.float32(1e-6) + offsets[:, None]


def pseudo_gradient(start: np.ndarray, seed: tuple[int, ...]) -> np.ndarray:
    """delta = 0.01 * start + 0.001 * seeded noise, in float32 (one block)."""
    noise = np.random.default_rng(list(seed)).standard_normal(start.shape, dtype=np.float32)
    return (np.float32(OUTER_SCALE) * start + np.float32(NOISE_SCALE) * noise).astype(np.float32)


@app.query("init")
def initial_model(message: Message, context: Context) -> Message:
    layers, width = _size(context)
    turn = _turn(context)
    writer = TensorFileWriter(_reply_file(context), large_layout(layers, width))
    for name in writer.layout:
        for rows in row_blocks(width, width):
            writer.write_at(name, rows.start * width * 4, initial_values(name, rows, width))
    return Message(RecordDict({"arrays": _record(writer, context, turn)}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    start = next(iter(message.content.array_records.values()))
    server_round = message_keys(message).get(protocol.SERVER_ROUND, 0)
    assert isinstance(server_round, int)
    layout = {name: (array.dtype, tuple(array.shape)) for name, array in start.items()}
    turn = _turn(context)
    writer = TensorFileWriter(_reply_file(context), layout)
    squares = 0.0
    for index, (name, array) in enumerate(start.items()):
        row_bytes = math.prod(array.shape[1:]) * np.dtype(array.dtype).itemsize
        for rows in row_blocks(array.shape[0] if array.shape else 1, row_bytes):
            block = _read_rows(array, rows, row_bytes)
            delta = pseudo_gradient(block, (server_round, context.node_id, index, rows.start))
            squares += float(np.square(delta, dtype=np.float64).sum())
            writer.write_at(name, rows.start * row_bytes, delta)
    metrics = MetricRecord(
        {
            protocol.WEIGHT: _setting(context, "large-examples", 1),
            protocol.TRAINABLE_PARAMS: sum(math.prod(shape) for _, shape in layout.values()),
            "train_loss": squares,
        }
    )
    return Message(
        RecordDict({"arrays": _record(writer, context, turn), "metrics": metrics}), reply_to=message
    )


def _read_rows(array: Array, rows: slice, row_bytes: int) -> np.ndarray:
    """Rows of a tensor: read from its file when it is a MappedArray (nothing stays mapped), else viewed."""
    shape = (rows.stop - rows.start, *array.shape[1:])
    if isinstance(array, MappedArray):
        raw = array.read_bytes(rows.start * row_bytes, (rows.stop - rows.start) * row_bytes)
        return np.frombuffer(raw, array.dtype).reshape(shape)
    return array_view(array).reshape(-1, *array.shape[1:])[rows]


def row_blocks(rows: int, row_bytes: int) -> Iterator[slice]:
    step = max(1, BLOCK_BYTES // max(row_bytes, 1))
    for first in range(0, rows, step):
        yield slice(first, min(first + step, rows))


def _record(writer: TensorFileWriter, context: Context, turn: int | None) -> ArrayRecord:
    mapped = removed_when_unused(
        writer.close(durable=False)
    )  # read back for the upload, then removed
    if turn is not None:  # the next site's turn comes when this reply's file goes
        weakref.finalize(next(iter(mapped.values())), os.close, turn)
    if context.node_config.get("large-in-memory", False):
        return ArrayRecord({name: Array(array.numpy()) for name, array in mapped.items()})
    return as_record(mapped)


def _turn(context: Context) -> int | None:
    """The shared lock of `large-turns`, held (a descriptor to close to let it go); None without it."""
    path = context.node_config.get("large-turns")
    if path is None:
        return None
    descriptor = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    return descriptor


def _size(context: Context) -> tuple[int, int]:
    return _setting(context, "large-layers"), _setting(context, "large-width")


def _setting(context: Context, key: str, default: int | None = None) -> int:
    """An integer setting of the node config, else of the run config, else `default`."""
    value = context.node_config.get(key, context.run_config.get(key, default))
    if not isinstance(value, int | float | str) or isinstance(value, bool):
        raise ValueError(
            f"the large site needs an integer {key!r} in its node config or run config"
        )
    return int(value)


def _reply_file(context: Context) -> Path:
    """A new file for this node's reply (`_record` has it removed once the site has sent the reply)."""
    folder = Path(str(context.node_config.get("large-dir", tempfile.gettempdir())))
    descriptor, path = tempfile.mkstemp(prefix="large-reply-", suffix=".safetensors", dir=folder)
    os.close(
        descriptor
    )  # the writer opens it again; an open descriptor would keep a removed file's blocks
    return Path(path)
