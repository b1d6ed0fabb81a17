"""A FedBuff buffer of a model larger than memory: the running sums sum_i w_i delta_i of the updates that arrived
since the last step live in a tensor file of the run folder, and each update is folded into them tensor by
tensor as it arrives, its own tensors read from wherever its upload put them (the blob store). The step then
reads the sums and the model a tensor at a time (`outer.step_by_tensor`). Resident memory is a window of a few
tensors, whatever the model's size and K.

Each tensor sees the operations of the in-memory buffer (`accumulator.WeightedDeltaAccumulator`, or for
Hydra-nets `MaskedDeltaAccumulator`, whose per-coordinate weights the file keeps beside the sums) in the same
order: the first update's w delta, then += w delta for each later one, / sum w at the step. So the sums, and
the model stepped from them, are the in-memory buffer's bit for bit.

The file lives from a buffer's first update to its step; the checkpoint, written after each step, never names
it (a resume starts a new buffer, as in memory), and sweeps one a crash left behind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from hydrafl.strategies.accumulator import (
    AggregationError,
    MaskedDeltaAccumulator,
    WeightedDeltaAccumulator,
)
from hydrafl.strategies.by_tensor import (
    BUFFER,
    RoundFiles,
    cut_to,
    delta_of,
    metric_contents,
    read_ahead,
)
from hydrafl.strategies.outer import OuterOptimizer, step_by_tensor
from hydrafl.subnet.slices import Slice
from hydrafl.tensor_files import MappedArray, TensorFileWriter, as_record
from hydrafl.updates import records


class BufferOnDisk:
    """The sums of one buffer in a file (created with its first update), their total weight, and the updates'
    metrics, each with its buffer weight."""

    parts: tuple[str, ...] = ("",)
    """What the file keeps per tensor, each under the tensor's name with this suffix."""

    def __init__(self, weighted_by_key: str) -> None:
        self.weighted_by_key = weighted_by_key
        self.file: TensorFileWriter | None = None
        self.summed: dict[str, None] = {}
        """The tensors some update changed, in the order first changed."""
        self.total_weight = 0.0
        self.metric_records: list[RecordDict] = []

    def add(self, reply: Message, arrays: ArrayRecord, files: RoundFiles) -> None:
        """Fold in `reply` (its weight already its buffer weight), tensor by tensor: each of its tensors and, when
        an earlier update started it, what the file keeps of it are read ahead, added, and written back in
        place. `arrays`: the model, which shapes the file."""
        if self.file is None:
            layout = {
                name + part: ("float32", tuple(array.shape))
                for name, array in arrays.items()
                for part in self.parts
            }
            self.file = files.writer(BUFFER, layout)
        [metrics] = records(reply.content, MetricRecord)
        weight = metrics[self.weighted_by_key]
        assert isinstance(weight, float)  # its buffer weight (`fedbuff.reweighted`)
        for name, delta, cut in read_ahead(delta_of(reply)[1], self._kept()):
            kept = [_tensor(delta_of(part)[1][name]) for part in cut]  # none: the update starts it
            folded = self.fold(name, cut_to(reply, name, delta), kept, tuple(arrays[name].shape))
            for part, values in zip(self.parts, folded, strict=True):
                self.file.write(name + part, values)
            self.summed[name] = None
        self.total_weight += weight  # in arrival order, as in memory
        self.metric_records += metric_contents([reply])

    def fold(
        self, name: str, update: Message, kept: list[torch.Tensor], shape: tuple[int, ...]
    ) -> list[torch.Tensor]:
        """What the file keeps of tensor `name` (`parts`) after `update`, cut to it, is folded into `kept`."""
        accumulator = WeightedDeltaAccumulator(self.weighted_by_key)
        if kept:  # else the sums start as w delta, as a fresh in-memory sum does
            [accumulator.sums[name]] = kept
        accumulator.add_all([update])
        return [accumulator.sums[name]]

    def step(
        self, outer: OuterOptimizer, arrays: ArrayRecord, scale: float, files: RoundFiles
    ) -> ArrayRecord:
        """The model `arrays` after `outer`'s step on the buffer's mean, times `scale`, written to `files`, a
        tensor at a time (`stepped`)."""

        def step(name: str, array: Array, cut: list[Message]) -> torch.Tensor:
            kept = [_tensor(delta_of(part)[1][name]) for part in cut]
            return self.stepped(outer, name, _tensor(array), kept, scale)

        return step_by_tensor(outer, arrays, self._kept(), files, step)

    def stepped(
        self,
        outer: OuterOptimizer,
        name: str,
        weights: torch.Tensor,
        kept: list[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Tensor `name` after the step: the mean (`mean`) times `scale`, then `outer`'s step, in place
        (`OuterOptimizer.step_`, the bits of `step`) or on the coordinates some update trained."""
        delta, trained = self.mean(name, kept)
        delta.mul_(scale)
        if trained is None:
            return outer.step_(name, weights, delta)
        return outer.masked_step(name, weights, delta, trained)

    def mean(self, name: str, kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The buffer's mean of tensor `name`, in place in what the file kept of it, read back; and the mask of
        the coordinates it covers (None: all)."""
        accumulator = WeightedDeltaAccumulator(self.weighted_by_key)
        [accumulator.sums[name]] = kept
        accumulator.total_weight = self.total_weight
        return accumulator.mean()[name], None

    def _kept(self) -> list[Message]:
        """What the file keeps of the tensors summed so far, one reply per part: the form `read_ahead` reads."""
        assert self.file is not None or not self.summed
        mapped = self.file.mapped() if self.file is not None else {}
        return [
            _as_reply({name: mapped[name + part] for name in self.summed}) for part in self.parts
        ]

    def discard(self) -> None:
        """Give the file up (the buffer stepped, or a resume starts a new one)."""
        if self.file is not None:
            self.file.discard()
        self.file, self.summed = None, {}


class MaskedBufferOnDisk(BufferOnDisk):
    """FedBuff over Hydra-nets: each update carries its site's slices (`slices_of(node)`), folded into full-shape
    sums and per-coordinate weights (`MaskedDeltaAccumulator.add_slices`); the step is the masked mean's, on the
    coordinates some update trained (`OuterOptimizer.masked_step`)."""

    parts = ("", "#weights")

    def __init__(
        self, weighted_by_key: str, slices_of: Callable[[int], Mapping[str, Slice]]
    ) -> None:
        super().__init__(weighted_by_key)
        self.slices_of = slices_of

    def fold(
        self, name: str, update: Message, kept: list[torch.Tensor], shape: tuple[int, ...]
    ) -> list[torch.Tensor]:
        node = update.metadata.src_node_id
        site = self.slices_of(node)
        if name not in site:
            raise AggregationError(
                f"reply from node {node} updates {name!r}, outside its subnetwork"
            )
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
        if kept:
            accumulator.sums[name], accumulator.weights[name] = kept
        accumulator.add_slices(update, {name: site[name]}, {name: shape})
        return [accumulator.sums[name], accumulator.weights[name]]

    def mean(self, name: str, kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
        accumulator.sums[name], accumulator.weights[name] = kept
        accumulator.metric_records = self.metric_records  # the buffer's updates: its mean has some
        [(delta, trained)] = accumulator.mean().values()
        return delta, trained


def _as_reply(arrays: dict[str, MappedArray]) -> Message:
    metadata = Metadata(
        run_id=0,
        message_id=BUFFER,
        src_node_id=0,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="",
        created_at=0.0,
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    return make_message(metadata=metadata, content=RecordDict({BUFFER: as_record(arrays)}))


def _tensor(array: Array) -> torch.Tensor:
    """An array's values, owned (read for this step: changed in place)."""
    return torch.from_numpy(array.numpy())
