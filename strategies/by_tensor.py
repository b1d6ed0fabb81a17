"""Aggregation tensor by tensor, for a global model larger than the coordinator's memory.

The model lives in a safetensors file (`tensor_files`), the replies where their uploads put them; a round
reads, for one tensor at a time, the start values and each reply's delta, and writes the new values into the
next model file. Resident memory is a window of one tensor per reply, whatever the model's size or the number
of sites, and the disk sees each reply and the model once.

Folding one tensor's cut of every reply gives that tensor exactly what folding the whole replies gives (every
rule here is coordinate-wise), so a model aggregated this way equals one aggregated in memory, bit for bit.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from hydrafl.strategies.accumulator import squared_blocks, tensor_view
from hydrafl.strategies.parallel_fold import FoldPool, empty
from hydrafl.tensor_files import Layout, OnDiskArray, TensorFileWriter, as_record

if TYPE_CHECKING:
    from hydrafl.privacy.central import CentralDp
    from hydrafl.strategies.staleness import BufferReport

MODEL = "model"
BUFFER = "buffer"


class RoundFiles:
    """Where round `server_round` writes its tensor files: `round-NNNNN-KIND-TOKEN.safetensors` in `folder`,
    beside the run's checkpoint, which commits them by naming them (a crash leaves files no checkpoint names,
    deleted at the next commit)."""

    def __init__(self, folder: Path, server_round: int) -> None:
        self.folder = folder
        self.server_round = server_round

    def writer(self, kind: str, layout: Layout) -> TensorFileWriter:
        self.folder.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(4)
        path = self.folder / f"round-{self.server_round:05d}-{kind}-{token}.safetensors"
        return TensorFileWriter(path, layout, {"format": f"hydrafl-{kind}/1"})


@runtime_checkable
class AggregatesByTensor(Protocol):
    """Aggregates a round tensor by tensor from disk to disk (a model larger than memory), by the same rule as
    its `aggregate_train`."""

    def by_tensor_refusal(self, arrays: ArrayRecord) -> str:
        """Why this strategy, as configured, cannot aggregate `arrays` tensor by tensor ("" when it can)."""

    def aggregate_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The new model, each tensor written with `files.writer(MODEL, ...)` (and the strategy's own state,
        e.g. momentum, in files of its own kind), and the train metrics. The caller (`FlowerAdapter`) hands
        over the round's valid replies, at least one, once `by_tensor_refusal` allows it."""


@runtime_checkable
class BuffersByTensor(Protocol):
    """Buffers asynchronous updates (`hooks.BuffersUpdates`) with a model on disk, by the same rule as its `add`
    and `step`: each update folded as it arrives into sums kept in a tensor file, the step taken tensor by
    tensor from that file and the model's into the next model's."""

    def add_on_disk(
        self, reply: Message, staleness: int, arrays: ArrayRecord, files: RoundFiles
    ) -> None:
        """`add` into the buffer's file (`files.writer(BUFFER, ...)`, shaped as `arrays`, the model now)."""

    def step_on_disk(
        self, arrays: ArrayRecord, files: RoundFiles
    ) -> tuple[ArrayRecord, MetricRecord | None, BufferReport]:
        """`step` of the model `arrays` kept on disk, the new model written with `files.writer(MODEL, ...)`;
        the buffer's file is given up."""


@runtime_checkable
class SumsByTensor(Protocol):
    """Steps, tensor by tensor, on the per-coordinate sums of a secure round (`hooks.TakesSecureSums`) of a model
    on disk, by the same rule as its `aggregate_summed`."""

    def aggregate_summed_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """`aggregate_by_tensor`'s contract, for the one reply holding ArrayRecords `sums` and `weights`."""


def follows_its_rule(strategy: object) -> bool:
    """Whether `strategy` aggregates tensor by tensor by the rule its `aggregate_train` follows: both written by
    the same class (a subclass that changes `aggregate_train` alone would be aggregated by its parent's rule)."""
    return isinstance(strategy, AggregatesByTensor) and _one_owner(
        strategy, "aggregate_train", "aggregate_by_tensor"
    )


def buffers_by_its_rule(strategy: object) -> bool:
    """Whether `strategy` buffers on disk by the rule its in-memory buffer follows (`follows_its_rule`): the
    class that wrote how an update is folded and stepped in memory (`add`, `new_accumulator`, `stepped`) wrote
    its sums on disk (`new_disk_sums`)."""
    return isinstance(strategy, BuffersByTensor) and _one_owner(
        strategy, "add", "new_accumulator", "stepped", "new_disk_sums"
    )


def sums_follow_their_rule(strategy: object) -> bool:
    """`follows_its_rule` for the secure sums: `aggregate_summed` and `aggregate_summed_by_tensor` written by the
    same class."""
    return isinstance(strategy, SumsByTensor) and _one_owner(
        strategy, "aggregate_summed", "aggregate_summed_by_tensor"
    )


def _one_owner(strategy: object, *methods: str) -> bool:
    """Whether one class of `strategy`'s wrote all of `methods` (a method it lacks has no owner)."""
    owners = {
        next((cls for cls in type(strategy).__mro__ if name in vars(cls)), None) for name in methods
    }
    return len(owners) == 1 and None not in owners


def one_tensor_sums(reply: Message, name: str) -> Message:
    """A secure round's reply (`read_ahead` cuts its `sums` to tensor `name`) with its `weights` cut to `name`
    too: what `MaskedDeltaAccumulator.add_sums` folds in for that tensor."""
    one = as_record({name: reply.content.array_records["weights"][name]})
    content = RecordDict(
        {key: one if key == "weights" else record for key, record in reply.content.items()}
    )
    return make_message(metadata=reply.metadata, content=content)


def delta_of(reply: Message) -> tuple[str, ArrayRecord]:
    """The key and record of a reply's delta (its first ArrayRecord)."""
    return next(
        (key, record) for key, record in reply.content.items() if isinstance(record, ArrayRecord)
    )


AHEAD = 3
"""Arrays read ahead of the one the caller works on: the read-ahead holds this many tensors, whatever the
number of sites."""


def read_ahead(
    start: ArrayRecord, replies: Sequence[Message], names: Sequence[str] | None = None
) -> Iterator[tuple[str, Array, list[Message]]]:
    """For each tensor of `start` (in the order of `names`, default `start`'s): its name, its start values and
    the replies that update it, each cut to it. Every array is read in the background, in the order the caller
    reads them (the start values, then each reply's), at most `AHEAD` before the caller asks for it: the disk
    reads on while the caller folds and writes, and memory does not grow with the number of sites. The caller
    reads each array it is given once (`numpy()` or `view()`)."""
    plan = [
        (name, [r for r in replies if name in delta_of(r)[1]]) for name in (names or list(start))
    ]
    arrays = [a for name, cut in plan for a in (start[name], *(delta_of(r)[1][name] for r in cut))]
    reader = _Reader(arrays)
    try:
        taken = iter(range(len(arrays)))
        for name, cut in plan:
            first = _Ahead(reader, next(taken), start[name])
            ahead = [_Ahead(reader, next(taken), delta_of(r)[1][name]) for r in cut]
            yield name, first, [cut_to(r, name, a) for r, a in zip(cut, ahead, strict=True)]
    finally:
        reader.close()


def read_values(array: Array) -> np.ndarray:
    """An array's values, owned by the caller; one on disk is read into reused pages (`parallel_fold.empty`)."""
    if not isinstance(array, OnDiskArray):
        return np.asarray(array.numpy())
    out = empty((array.nbytes,), torch.uint8).numpy().view(array.dtype).reshape(array.shape)
    return array.read_into(out)


class _Reader:
    """Reads `arrays` in order in one background thread, at most `AHEAD` ready and not yet taken."""

    def __init__(self, arrays: list[Array]) -> None:
        self._slots = threading.Semaphore(AHEAD)
        self._ready: dict[int, np.ndarray | BaseException] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(
            target=self._read, args=(arrays,), name="read-ahead", daemon=True
        )
        self._thread.start()

    def _read(self, arrays: list[Array]) -> None:
        for index, array in enumerate(arrays):
            self._slots.acquire()
            if self._closed:
                return
            try:
                values: np.ndarray | BaseException = read_values(array)
            except BaseException as error:  # handed to the caller that asks for this array
                values = error
            with self._changed:
                self._ready[index] = values
                self._changed.notify_all()

    def take(self, index: int) -> np.ndarray:
        with self._changed:
            self._changed.wait_for(lambda: index in self._ready)
            values = self._ready.pop(index)
        self._slots.release()
        if isinstance(values, BaseException):
            raise values
        return values

    def close(self) -> None:
        """Stop reading (the caller is done, or failed): the thread ends after the array it is reading."""
        self._closed = True
        self._slots.release()  # a thread waiting for a slot wakes to find the reader closed
        self._thread.join()


class _Ahead(OnDiskArray):
    """An array being read in the background (`read_ahead`): `numpy()` waits for its values and hands them over."""

    def __init__(self, reader: _Reader, index: int, base: Array) -> None:
        super().__init__(base.dtype, tuple(base.shape))
        self.__dict__.update(reader=reader, index=index)
        self.__dict__["checked_finite"] = getattr(base, "checked_finite", False)

    def numpy(self) -> np.ndarray:
        return self.__dict__["reader"].take(self.__dict__["index"])


def cut_to(reply: Message, name: str, array: Array) -> Message:
    """`reply` with its delta cut to the one array `name`, `array` (read ahead, or read later)."""
    key, _ = delta_of(reply)
    one = ArrayRecord()  # item by item: ArrayRecord(dict) would copy the array into a plain one
    one[name] = array
    content = RecordDict({k: one if k == key else record for k, record in reply.content.items()})
    return make_message(metadata=reply.metadata, content=content)


def clip_factors(replies: Sequence[Message], dp: CentralDp, pool: FoldPool) -> dict[int, float]:
    """Each reply's central-DP clip factor (by its site's node id), from the L2 norm of its whole delta read one
    tensor at a time (in the reply's order and block by block, as the in-memory fold sums it): a second read of
    every reply, the price of a bound over the whole update without holding it."""
    factors = {}
    for reply in replies:
        squares = [
            square
            for array in delta_of(reply)[1].values()
            for square in squared_blocks(pool, tensor_view(array))
        ]
        factors[reply.metadata.src_node_id] = dp.clip_factor_of_norm(float(np.sqrt(sum(squares))))
    return factors


def metric_contents(replies: Sequence[Message]) -> list[RecordDict]:
    """The replies' metrics alone, as Flower's metric aggregation functions take them."""
    return [RecordDict(dict(reply.content.metric_records)) for reply in replies]
