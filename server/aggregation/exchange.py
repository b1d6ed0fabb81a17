"""The receive step of a round: its messages out to the grid, their replies back as they arrive.

Every exchange of a round (the strategy's queries, train and evaluate messages, the secure-aggregation stages,
the diagnostics' reference site) goes through one `Exchange`, so each has the round's deadline and group id
and compressed downloads (`--compress-downloads`) learn which sites hold which model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from hydrafl.compression.downloads import DownloadCompression
from hydrafl.rounds import RoundRecord
from hydrafl.server.aggregation.traffic import count_down


def query(
    node: int,
    message_type: str,
    keys: Mapping[str, bool | int] | None = None,
    *,
    arrays: ArrayRecord | None = None,
) -> Message:
    """A query outside the rounds (initial model, statistics, curvature, deduplication) carrying only its own
    keys: the run's settings reach each site once per run."""
    content = RecordDict({"config": ConfigRecord(dict(keys or {}))})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, dst_node_id=node, message_type=message_type)


class Exchange:
    """Sends messages over `grid` with the round's deadline; `downloads` compresses the models they carry."""

    def __init__(self, grid: Grid, downloads: DownloadCompression, timeout_s: float | None) -> None:
        self.grid = grid
        self.downloads = downloads
        self.timeout_s = timeout_s

    def outgoing(
        self,
        messages: Sequence[Message],
        server_round: int,
        record: RoundRecord,
        *,
        full: bool = False,
    ) -> list[Message]:
        """`messages` as they go on the wire (each model compressed against what its site holds, or whole with
        `full`), their bytes counted in `record`."""
        wire = self.downloads.prepare(messages, server_round, full=full)
        count_down(wire, record)
        return wire

    def __call__(self, messages: Sequence[Message], server_round: int) -> Iterator[Message]:
        """The replies as the grid yields them (in the order they arrive), so none need wait for the others."""
        if not messages:
            return iter(())
        for (
            message
        ) in messages:  # Flower's strategies leave group_id empty; runtimes key rounds on it
            message.metadata.group_id = str(server_round)
        return self.downloads.settle(
            messages, self.grid.send_and_receive(messages, timeout=self.timeout_s)
        )
