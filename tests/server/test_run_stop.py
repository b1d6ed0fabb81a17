"""`hydrafl admin run stop`: a stock ServerApp's run stops before its next round's broadcast, `--now` stops any
run at the grid's next poll, and only a pending or running run stops (a pending one at once)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict
from helpers import started_coordinator_run

from hydrafl.server.lease_keeper import LeasedGrid, RunStopped
from hydrafl.server.stock_app_grid import StockAppGrid
from hydrafl.server.tables import STOP_AT_ROUND_END, STOP_NOW


def _train_round(node_id: int, server_round: int) -> list[Message]:
    arrays = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    message = Message(RecordDict({"arrays": arrays}), dst_node_id=node_id, message_type="train")
    message.metadata.group_id = str(server_round)
    return [message]


def test_a_stock_app_run_stops_before_its_next_round_and_now_stops_at_the_next_poll(tmp_path):
    coordinator, grid, [(site, _)] = started_coordinator_run(tmp_path, "a")
    store, run_id = coordinator.store, grid.run.run_id
    try:
        stock = StockAppGrid(
            store, coordinator.blobs, coordinator.service, run_id, lease=coordinator.lease
        )
        stock.push_messages(_train_round(site.node_id, 1))
        store.request_stop(run_id, STOP_AT_ROUND_END)
        with pytest.raises(RunStopped, match="after round 1"):
            stock.push_messages(_train_round(site.node_id, 2))
        assert (store.run(run_id).rounds_done, stock.train_rounds) == (1, 1)

        leased = LeasedGrid(
            store, coordinator.blobs, coordinator.service, run_id, lease=coordinator.lease
        )
        with pytest.raises(RunStopped, match="before its first round"):
            leased.get_node_ids()  # still waiting for its sites: no round to finish
        leased.push_messages(_train_round(site.node_id, 2))
        assert list(leased.get_node_ids()) == []  # a round in progress: a stop at its end waits
        assert list(leased.pull_messages(["none"])) == []
        store.request_stop(run_id, STOP_NOW)
        with pytest.raises(RunStopped, match="in the middle of a round"):
            leased.pull_messages(["none"])
    finally:
        coordinator.stop()


def test_only_a_pending_or_running_run_stops(tmp_path):
    coordinator, grid, _ = started_coordinator_run(tmp_path)
    store = coordinator.store
    try:
        pending = store.create_run({"strategy": "fedavg", "rounds": 1})
        assert store.request_stop(pending.id, STOP_AT_ROUND_END) == "stopped"
        assert store.run(pending.id).status == "stopped"
        store.set_run_status(grid.run.run_id, "finished")
        with pytest.raises(ValueError, match="is finished: only a pending or running run stops"):
            store.request_stop(grid.run.run_id, STOP_NOW)
        store.resume_run(pending.id)
        assert (store.run(pending.id).status, store.stop_requested(pending.id)) == ("pending", "")
        with pytest.raises(ValueError, match="only a stopped run resumes"):
            store.resume_run(pending.id)
    finally:
        coordinator.stop()
