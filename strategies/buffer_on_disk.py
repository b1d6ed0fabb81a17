"""A FedBuff buffer of a model larger than memory: the running sums sum_i w_i delta_i of the updates that arrived
since the last step live in a tensor file of the run folder, and each update is folded into them tensor by
tensor as it arrives, its own tensors read from wherever its upload put them (the blob store). The step then
reads the sums and the model a tensor at a time (`outer.step_by_tensor`). Resident memory is a window of a few
tensors, whatever the model's size and K.

Each tensor sees the operations of the in-memory buffer (`accumulator.WeightedDeltaAccumulator`) in the same
order: the first update's w delta, then += w delta for each later one, / sum w at the step. So the sums, and
the model stepped from them, are the in-memory buffer's bit for bit.

The file lives from a buffer's first update to its step; the checkpoint, written after each step, never names
it (a resume starts a new buffer, as in memory), and sweeps one a crash left behind.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from hydrafl.strategies.accumulator import WeightedDeltaAccumulator
from hydrafl.strategies.by_tensor import BUFFER, RoundFiles, delta_of, metric_contents, read_ahead
from hydrafl.strategies.outer import OuterOptimizer, step_by_tensor
from hydrafl.tensor_files import MappedArray, TensorFileWriter, as_record
from hydrafl.updates import records


class BufferOnDisk:
    """The sums of one buffer in a file (created with its first update), their total weight, and the updates'
    metrics, each with its buffer weight."""

    def __init__(self, weighted_by_key: str) -> None:
        self.weighted_by_key = weighted_by_key
        self.file: TensorFileWriter | None = None
        self.summed: dict[str, MappedArray] = {}
        """The sums of the tensors some update changed, in the order first changed."""
        self.total_weight = 0.0
        self.metric_records: list[RecordDict] = []

    def add(self, reply: Message, arrays: ArrayRecord, files: RoundFiles) -> None:
        """Fold in `reply` (its weight already its buffer weight), tensor by tensor: each of its tensors and, when
        an earlier update started it, that tensor's sums are read ahead, added, and written back in place.
        `arrays`: the model, which shapes the file."""
        if self.file is None:
            layout = {name: ("float32", tuple(array.shape)) for name, array in arrays.items()}
            self.file = files.writer(BUFFER, layout)
        [metrics] = records(reply.content, MetricRecord)
        weight = metrics[self.weighted_by_key]
        assert isinstance(weight, float)  # its buffer weight (`fedbuff.reweighted`)
        mapped = self.file.mapped()
        for name, delta, cut in read_ahead(delta_of(reply)[1], [self._sums()]):
            accumulator = WeightedDeltaAccumulator(self.weighted_by_key)
            if cut:  # else the sums start as w delta, as a fresh in-memory sum does
                accumulator.sums[name] = _tensor(delta_of(cut[0])[1][name])
            accumulator.add_weighted({name: _tensor(delta)}, weight)
            self.file.write(name, accumulator.sums[name])
            self.summed.setdefault(name, mapped[name])
        self.total_weight += weight  # in arrival order, as in memory
        self.metric_records += metric_contents([reply])

    def step(
        self, outer: OuterOptimizer, arrays: ArrayRecord, scale: float, files: RoundFiles
    ) -> ArrayRecord:
        """The model `arrays` after `outer`'s step on the buffer's mean, times `scale`, written to `files`: per
        tensor, the mean in place in the sums read back (`WeightedDeltaAccumulator.mean`), then the step."""
        total_weight = self.total_weight

        def step(name: str, array: Array, cut: list[Message]) -> torch.Tensor:
            accumulator = WeightedDeltaAccumulator(self.weighted_by_key)
            accumulator.sums[name] = _tensor(delta_of(cut[0])[1][name])
            accumulator.total_weight = total_weight
            return outer.step_(name, _tensor(array), accumulator.mean()[name].mul_(scale))

        return step_by_tensor(outer, arrays, [self._sums()], files, step)

    def _sums(self) -> Message:
        """The sums so far as a reply, the form `read_ahead` reads."""
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
        return make_message(metadata=metadata, content=RecordDict({"sums": as_record(self.summed)}))

    def discard(self) -> None:
        """Give the file up (the buffer stepped, or a resume starts a new one)."""
        if self.file is not None:
            self.file.discard()
        self.file, self.summed = None, {}


def _tensor(array: Array) -> torch.Tensor:
    """An array's values, owned (read for this step: changed in place)."""
    return torch.from_numpy(array.numpy())
