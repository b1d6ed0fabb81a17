"""A coordinator whose database refuses it (locked, or out of descriptors to open it) logs each failure, its
failures to record a failure included, and keeps serving: nothing it cannot record ends the process."""

from __future__ import annotations

import logging
import sqlite3
import threading

from deployment import wait_until

from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator


def test_a_run_failure_the_database_refuses_to_record_is_logged_and_the_coordinator_keeps_serving(
    tmp_path, caplog
):
    db_path = tmp_path / "c.db"
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=f"sqlite:///{db_path}",
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
        )
    )
    coordinator.start()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            coordinator.serve_forever(idle_poll_s=0.1)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=serve)
    try:
        run = coordinator.store.create_run(
            {"strategy": "no-such-strategy", "rounds": 1}
        )  # fails when started
        locker = sqlite3.connect(db_path, timeout=0)
        locker.execute(
            "BEGIN EXCLUSIVE"
        )  # every write (and, without WAL, every read) now fails after its timeout
        with caplog.at_level(logging.WARNING, logger="hydrafl.server.coordinator"):
            thread.start()
            wait_until(
                lambda: "database is locked" in caplog.text or errors,
                30,
                "the refusal was not logged",
            )
            assert not errors, errors
            assert thread.is_alive()
            locker.rollback()
            locker.close()
            wait_until(
                lambda: coordinator.store.run(run.id).status == "failed",
                30,
                "the run's failure was not recorded",
            )
        assert "no-such-strategy" in coordinator.store.run(run.id).detail
        assert thread.is_alive() and not errors
    finally:
        coordinator.stopping.set()
        if thread.is_alive():
            thread.join(timeout=30)
        coordinator.stop()
