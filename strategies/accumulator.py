"""Streaming aggregation: replies are folded into running sums one at a time.

Memory stays O(model) whatever the number of sites: a reply's arrays are read in place (views of its bytes,
an in-memory buffer or a memory-mapped file alike, never copied), and folded block by block into sums
preallocated once, with no model-sized temporaries. The blocks run on a small pool of threads that claim them
one at a time (`parallel_fold`), which keeps the sums near the memory-bandwidth limit, keeps them fast when
another process holds a core, and makes them bit-identical whatever the thread count.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from hydrafl.arrays import HeldArray, array_view
from hydrafl.strategies import parallel_fold as fold
from hydrafl.subnet.slices import Slice
from hydrafl.tensor_files import OnDiskArray
from hydrafl.updates import records

if TYPE_CHECKING:
    from hydrafl.privacy.central import CentralDp


GROUP = 8
"""Resident replies folded together per block (`WeightedDeltaAccumulator.add_all`)."""


class AggregationError(ValueError):
    """Replies cannot be combined (no successful reply, or a reply of the wrong shape)."""


class WeightedDeltaAccumulator:
    """Running sum_k w_k * delta_k and sum_k w_k over the replies seen so far. With central DP (`dp`) every
    reply is clipped and weighs 1, and the mean gets the mechanism's noise. `threads`: the fold's thread pool
    (default: torch's thread count)."""

    weighted_by_key: str
    dp: CentralDp | None
    sums: dict[str, torch.Tensor]
    total_weight: float
    metric_records: list[RecordDict]
    pool: fold.FoldPool

    def __init__(
        self,
        weighted_by_key: str = "num-examples",
        *,
        dp: CentralDp | None = None,
        threads: int | None = None,
    ) -> None:
        self.weighted_by_key = weighted_by_key
        self.dp = dp
        self.sums = {}
        self.total_weight = 0.0
        self.metric_records = []
        self.pool = fold.FoldPool(threads)

    def add(self, reply: Message) -> None:
        """Fold in one reply; every shape is checked before anything is added."""
        self._add_group([reply])

    def add_all(self, replies: Iterable[Message]) -> None:
        """Fold in every successful reply. Replies already in memory (a list) are folded GROUP at a time, block
        by block: each block of the sums stays in cache while the group's blocks are added to it, so the sums
        cross the memory bus once per group instead of once per reply; every element sees the same operations
        in the same order as one by one, so the result is bit-identical. An iterator, or replies memory-mapped
        from files (whose pages a fold makes resident until it releases them), are folded one reply at a time."""
        if not isinstance(replies, Sequence):
            arriving = iter(replies)
            while (reply := next(arriving, None)) is not None:
                if not reply.has_error():
                    self.add(reply)
                del (
                    reply
                )  # before the next one arrives: a `for` loop would hold two replies at a time
            return
        resident = [reply for reply in replies if not reply.has_error()]
        group = 1 if any(map(_mapped, resident)) else GROUP
        for start in range(0, len(resident), group):
            self._add_group(resident[start : start + group])

    def add_weighted(self, deltas: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold in one update with a weight given by the caller, counted once: a reply's clipped update (factor
        `weight`) when its norm was taken over the whole reply elsewhere, one tensor at a time
        (`by_tensor.clip_factors`)."""
        self.total_weight += 1.0
        self._fold([(deltas, weight)])

    def _add_group(self, replies: Sequence[Message]) -> None:
        """Check, weigh (DP: clip) and fold replies in order; a bad reply raises after those before it are folded."""
        shapes = {name: total.shape for name, total in self.sums.items()}
        parsed: list[tuple[ArrayRecord, dict[str, torch.Tensor], float]] = []
        try:
            for reply in replies:
                arrays, metrics, weight = _parse(reply, self.weighted_by_key)
                deltas = _views(arrays)
                for name, delta in deltas.items():
                    if shapes.setdefault(name, delta.shape) != delta.shape:
                        raise AggregationError(
                            f"array {name!r} has shape {tuple(delta.shape)}, expected {tuple(shapes[name])}"
                        )
                if self.dp is not None:
                    weight = self.dp.clip_factor_of_norm(
                        _norm(self.pool, deltas)
                    )  # counted once, at most C
                parsed.append((arrays, deltas, weight))
                self.total_weight += weight if self.dp is None else 1.0
                self.metric_records.append(RecordDict({"metrics": metrics}))
        finally:
            self._fold([(deltas, weight) for _, deltas, weight in parsed])
            for arrays, _, _ in parsed:
                _release(arrays)

    def _fold(self, terms: Sequence[tuple[Mapping[str, torch.Tensor], float]]) -> None:
        """sums[name] += sum_k weight_k * deltas_k[name], one task per block of each name over all the terms."""
        tasks = []
        for name in dict.fromkeys(name for deltas, _ in terms for name in deltas):
            members = [(deltas[name], weight) for deltas, weight in terms if name in deltas]
            fresh = name not in self.sums
            if fresh:
                self.sums[name] = fold.empty(tuple(members[0][0].shape))
            columns = [fold.blocks(delta) for delta, _ in members]
            for index, (total,) in enumerate(fold.blocks(self.sums[name])):
                block_terms = [
                    (column[index][0], weight)
                    for column, (_, weight) in zip(columns, members, strict=True)
                ]
                tasks.append((total, block_terms, fresh))
        self.pool.run(fold.axpy_terms, tasks)

    def mean(self, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The weighted mean of the arrays `names` (default: all), computed in place: the accumulator is spent
        afterwards. Only those are released, so only those get DP noise; the others still counted in each reply's
        norm (a LoRA baseline's head takes the arrays that are not factors: its factors have their own fold)."""
        if not self.total_weight:
            raise AggregationError("no successful reply to aggregate")
        means = (
            self.sums
            if names is None
            else {name: self.sums[name] for name in names if name in self.sums}
        )
        tasks = [
            (*block, self.total_weight) for total in means.values() for block in fold.blocks(total)
        ]
        self.pool.run(fold.divide, tasks)
        if self.dp is not None:
            for tensor in means.values():
                self.dp.noise_(tensor, self.total_weight)
            self.dp.end_round()
        return means


class MaskedDeltaAccumulator:
    """Per-coordinate running sums for subnetwork updates: sum_k w_k m_k delta_k and sum_k w_k m_k, where
    m_k is the 0/1 mask of the coordinates site k was assigned (a site's values outside it are ignored). With
    central DP (`dp`) every reply is clipped and weighs 1, and coordinate k's mean gets noise z C / n_k.
    `threads`: the fold's thread pool (default: torch's thread count)."""

    weighted_by_key: str
    dp: CentralDp | None
    sums: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    metric_records: list[RecordDict]
    pool: fold.FoldPool

    def __init__(
        self,
        weighted_by_key: str = "num-examples",
        *,
        dp: CentralDp | None = None,
        threads: int | None = None,
    ) -> None:
        self.weighted_by_key = weighted_by_key
        self.dp = dp
        self.sums = {}
        self.weights = {}
        self.metric_records = []
        self.pool = fold.FoldPool(threads)

    def add(self, reply: Message, masks: Mapping[str, torch.Tensor]) -> None:
        """Fold in one reply; `masks` (bool, full shape) are the coordinates its site was assigned."""
        arrays, metrics, weight = _parse(reply, self.weighted_by_key)
        unassigned = sorted(set(arrays.keys()) - set(masks))
        if unassigned:
            raise AggregationError(
                f"reply from node {reply.metadata.src_node_id} updates {unassigned[:3]}, outside its subnetwork"
            )
        deltas = _views(arrays)
        for name, delta in deltas.items():
            if delta.shape != masks[name].shape:
                raise AggregationError(
                    f"array {name!r} has shape {tuple(delta.shape)}, expected {tuple(masks[name].shape)}"
                )
            self._check_shape(name, delta.shape)
        bool_masks = {name: _as_bool(masks[name]) for name in deltas}
        counted = weight
        if self.dp is not None:  # clipped over its assigned coordinates, counted once
            weight = self.dp.clip_factor_of_norm(_norm(self.pool, deltas, bool_masks))
            counted = 1.0
        tasks = []
        for name, delta in deltas.items():
            fresh = self._allocate(name, delta.shape)
            tasks += [
                (*block, weight, counted, fresh)
                for block in fold.blocks(
                    self.sums[name], self.weights[name], delta, bool_masks[name]
                )
            ]
        self.pool.run(fold.masked_axpy, tasks)
        _release(arrays)
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def add_slices(
        self,
        reply: Message,
        slices: Mapping[str, Slice],
        shapes: Mapping[str, tuple[int, ...]],
        *,
        count_once: bool = False,
    ) -> None:
        """Fold in one reply that carries only its subnetwork's slices (compact tensors of `Slice.take`'s shape),
        straight into the full-shape sums. `count_once`: every site weighs 1 instead of its weight (the plain
        mean over the sites that trained a coordinate). Every shape is checked before anything is added."""
        arrays, metrics, weight = _parse(reply, self.weighted_by_key)
        node = reply.metadata.src_node_id
        unassigned = sorted(set(arrays.keys()) - set(slices))
        if unassigned:
            raise AggregationError(
                f"reply from node {node} updates {unassigned[:3]}, outside its subnetwork"
            )
        deltas = _views(arrays)
        for name, delta in deltas.items():
            expected = slices[name].taken_shape(shapes[name])
            if tuple(delta.shape) != expected:
                raise AggregationError(
                    f"reply from node {node}: array {name!r} has shape {tuple(delta.shape)}, its slice is {expected}"
                )
            self._check_shape(name, shapes[name])
        weight = 1.0 if count_once else weight
        if self.dp is not None:
            weight = self.dp.clip_factor_of_norm(_norm(self.pool, deltas))
        counted = 1.0 if self.dp is not None else weight
        whole, sliced = [], []
        for name, delta in deltas.items():
            fresh = self._allocate(name, shapes[name])
            if slices[name].dim is None:
                for total, counts, values in fold.blocks(
                    self.sums[name], self.weights[name], delta
                ):
                    whole += [
                        (fold.axpy, (total, values, weight, fresh)),
                        (fold.add_scalar, (counts, counted, fresh)),
                    ]
            else:
                if fresh:
                    self._zero(name)
                sliced += _sliced_tasks(
                    self.sums[name], self.weights[name], slices[name], delta, weight, counted
                )
        self.pool.run(_call, whole + sliced)
        _release(arrays)
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def add_sums(self, reply: Message) -> None:
        """Fold in pre-summed replies (secure aggregation): one reply holding ArrayRecords `sums` and `weights`
        of full shapes, and the metrics."""
        metrics = _only(records(reply.content, MetricRecord), "MetricRecord", reply)
        sums, weights = reply.content["sums"], reply.content["weights"]
        sum_views, weight_views = _views(sums), _views(weights)
        tasks = []
        for name, total in sum_views.items():
            weight = weight_views[name]
            if total.shape != weight.shape:
                raise AggregationError(
                    f"array {name!r}: sums of shape {tuple(total.shape)}, weights {tuple(weight.shape)}"
                )
            self._check_shape(name, total.shape)
        for name, total in sum_views.items():
            weight = weight_views[name]
            fresh = self._allocate(name, total.shape)
            for target, values in ((self.sums[name], total), (self.weights[name], weight)):
                tasks += [(*block, 1.0, fresh) for block in fold.blocks(target, values)]
        self.pool.run(fold.axpy, tasks)
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def mean(
        self, names: Collection[str] | None = None
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per name of `names` (default: all): (masked weighted mean delta, 0 where no site trained; bool mask of
        trained coordinates). Computed in place: the accumulator is spent afterwards. Only those are released,
        so only those get DP noise (`WeightedDeltaAccumulator.mean`)."""
        if not self.metric_records:
            raise AggregationError("no successful reply to aggregate")
        out, tasks = {}, []
        sizes = [total.numel() for total in self.sums.values()]
        flags = fold.empty((sum(sizes),), torch.bool).split(
            sizes
        )  # one mapping: huge pages for small layers too
        for (name, total), covered in zip(self.sums.items(), flags, strict=True):
            covered = covered.view(total.shape)
            out[name] = (total, covered)
            tasks += fold.blocks(total, self.weights[name], covered)
        self.pool.run(fold.masked_mean, tasks)
        if names is not None:
            out = {name: out[name] for name in names if name in out}
        if self.dp is not None:
            for name, (
                total,
                covered,
            ) in out.items():  # the counts were clamped: 1e-30 where none counted
                self.dp.noise_(total, torch.where(covered, self.weights[name], 0.0))
            self.dp.end_round()
        self.weights = {}  # their pages go to the next round's sums
        return out

    def _allocate(self, name: str, shape: tuple[int, ...]) -> bool:
        """Uninitialised sums for a name first seen (True: the caller's first fold writes every coordinate)."""
        if name in self.sums:
            return False
        self.sums[name], self.weights[name] = fold.empty(shape), fold.empty(shape)
        return True

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if name in self.sums and tuple(self.sums[name].shape) != tuple(shape):
            raise AggregationError(
                f"array {name!r} has shape {tuple(shape)}, expected {tuple(self.sums[name].shape)}"
            )

    def _zero(self, name: str) -> None:
        self.pool.run(fold.zero, fold.blocks(self.sums[name]) + fold.blocks(self.weights[name]))


def _sliced_tasks(
    total: torch.Tensor,
    counts: torch.Tensor,
    sl: Slice,
    values: torch.Tensor,
    alpha: float,
    counted: float,
) -> list[tuple]:
    """Slice.add_to of `values` (and of `counted` into the counts) cut into row blocks of about BLOCK elements:
    along dim 0 when the slice is along another dim, else along the slice's own indices."""
    index = torch.tensor(sl.index, dtype=torch.long)
    ones = torch.ones((), dtype=torch.float32).expand(
        values.shape
    )  # stride 0: no model-sized tensor of ones
    rows = max(1, fold.BLOCK * values.shape[0] // max(1, values.numel()))
    tasks = []
    for start, stop in fold.spans(values.shape[0], rows):
        if sl.dim == 0:
            target, target_counts, idx = total, counts, index[start:stop]
        else:
            target, target_counts, idx = total[start:stop], counts[start:stop], index
        tasks += [
            (torch.Tensor.index_add_, (target, sl.dim, idx, values[start:stop]), {"alpha": alpha}),
            (
                torch.Tensor.index_add_,
                (target_counts, sl.dim, idx, ones[start:stop]),
                {"alpha": counted},
            ),
        ]
    return tasks


def _call(
    function: Callable[..., object], args: tuple, kwargs: Mapping[str, float] | None = None
) -> None:
    function(*args, **(kwargs or {}))


def _norm(
    pool: fold.FoldPool,
    deltas: Mapping[str, torch.Tensor],
    masks: Mapping[str, torch.Tensor] | None = None,
) -> float:
    """The L2 norm of all of one reply's arrays together (of mask * delta with `masks`), block by block in
    float64: a fixed sum order and no model-sized temporaries."""
    squares = [
        square
        for name, delta in deltas.items()
        for square in squared_blocks(pool, delta, None if masks is None else masks[name])
    ]
    return float(np.sqrt(sum(squares)))


def squared_blocks(
    pool: fold.FoldPool, tensor: torch.Tensor, mask: torch.Tensor | None = None
) -> list[float]:
    """The squared L2 norm of each block of `tensor` (masked), in block order: summed in that order over a
    reply's tensors, the reply's squared norm, the same whether its tensors are read together or one by one."""
    blocks = fold.blocks(tensor, mask)
    squares = [0.0] * len(blocks)
    pool.run(fold.squared_norm, [(squares, index, *block) for index, block in enumerate(blocks)])
    return squares


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask.to(torch.bool)


def _parse(reply: Message, weighted_by_key: str) -> tuple[ArrayRecord, MetricRecord, float]:
    arrays = _only(
        records(reply.content, ArrayRecord), "ArrayRecord", reply
    )  # `records`: why not Flower's views
    metrics = _only(records(reply.content, MetricRecord), "MetricRecord", reply)
    weight = float(metrics[weighted_by_key])
    if weight <= 0:
        raise AggregationError(
            f"reply from node {reply.metadata.src_node_id} has {weighted_by_key}={weight}"
        )
    return arrays, metrics, weight


def _views(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    return {name: tensor_view(array) for name, array in arrays.items()}


def tensor_view(array: Array) -> torch.Tensor:
    """An Array's values as a read-only torch view (`array_view`), only ever read, never written."""
    with warnings.catch_warnings():  # torch warns that the view is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array_view(array))


def _release(arrays: ArrayRecord) -> None:
    """Unmap the pages of a folded reply whose bytes are a read-only memory-mapped file (the blob store's
    uploads): the file stays in the page cache, but the process keeps only its sums resident, however many
    replies the round holds. Other buffers are left alone (dropping the pages of a writable or anonymous
    mapping would lose data)."""
    for array in arrays.values():
        if isinstance(
            array, OnDiskArray | HeldArray
        ):  # maps of its own, gone with the views; memory
            continue
        view = memoryview(array.data)
        mapping = _mapping(array.data)
        if mapping is None or not view.readonly or not view.nbytes:
            continue
        offset = (
            np.frombuffer(view, np.uint8).ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data
        )
        start = (
            -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        )  # only whole pages inside the array's bytes
        stop = (offset + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _mapped(reply: Message) -> bool:
    arrays = (array for record in records(reply.content, ArrayRecord) for array in record.values())
    return any(
        isinstance(array, OnDiskArray)
        or (not isinstance(array, HeldArray) and _mapping(array.data) is not None)
        for array in arrays
    )


def _mapping(buffer: object) -> mmap.mmap | None:
    """The mmap under a buffer (an mmap, a memoryview of one, a numpy array or memmap over one), if any."""
    while buffer is not None and not isinstance(buffer, mmap.mmap):
        buffer = buffer.obj if isinstance(buffer, memoryview) else getattr(buffer, "base", None)
    return buffer


def _only(records: list, kind: str, reply: Message) -> ArrayRecord | MetricRecord:
    if len(records) != 1:
        raise AggregationError(
            f"reply from node {reply.metadata.src_node_id} must hold exactly one {kind}, found {len(records)}"
        )
    return records[0]
