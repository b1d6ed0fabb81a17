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
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from hydrafl.tensor_files import Layout, TensorFileWriter

MODEL = "model"


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
    """Aggregates a round tensor by tensor from disk to disk (a model larger than memory)."""

    def aggregate_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The new model, each tensor written with `files.writer(MODEL, ...)` (and the strategy's own state,
        e.g. momentum, in files of its own kind), and the train metrics."""


def delta_of(reply: Message) -> tuple[str, ArrayRecord]:
    """The key and record of a reply's delta (its first ArrayRecord)."""
    return next(
        (key, record) for key, record in reply.content.items() if isinstance(record, ArrayRecord)
    )


def tensor_replies(replies: Sequence[Message], name: str) -> list[Message]:
    """Each reply whose delta has tensor `name`, cut to that tensor; the rest of its content kept."""
    cut = []
    for reply in replies:
        key, delta = delta_of(reply)
        if name not in delta:
            continue
        one = ArrayRecord()  # item by item: ArrayRecord(dict) would copy the array into a plain one
        one[name] = delta[name]
        content = RecordDict(
            {k: one if k == key else record for k, record in reply.content.items()}
        )
        cut.append(make_message(metadata=reply.metadata, content=content))
    return cut


def metric_contents(replies: Sequence[Message]) -> list[RecordDict]:
    """The replies' metrics alone, as Flower's metric aggregation functions take them."""
    return [RecordDict(dict(reply.content.metric_records)) for reply in replies]
