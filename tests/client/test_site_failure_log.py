"""A message that fails at the site is one WARNING line in the site's log; its traceback only with -v (DEBUG)."""

from __future__ import annotations

import logging
import threading

import numpy as np
from fake_coordinator import FakeCoordinator, coordinator_message, serve_in_thread
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from hydrafl.client.agent import SiteAgent

failing_app = ClientApp()


@failing_app.query("fail")
def _fail(message: Message, context: Context) -> Message:
    raise RuntimeError("the site's own bug")


def _failed_records(caplog, level: int) -> list[logging.LogRecord]:
    coordinator = FakeCoordinator()
    server = coordinator.start()
    stop = threading.Event()
    caplog.set_level(level, logger="hydrafl.client.agent")
    thread, raised = serve_in_thread(
        SiteAgent(coordinator.address, "site-token", failing_app, {}).run, stop
    )
    try:
        sent = coordinator.send(
            coordinator_message("query.fail", {"w": np.ones(3, dtype=np.float32)})
        )
        coordinator.reply_to(sent, thread.is_alive)
    finally:
        stop.set()
        thread.join(timeout=10)
        server.stop(grace=None)
    assert not raised, raised
    return [
        r for r in caplog.records if "failed" in r.getMessage() and r.levelno == logging.WARNING
    ]


def test_a_failed_message_logs_one_line_without_verbose(caplog):
    (record,) = _failed_records(caplog, logging.INFO)
    assert "RuntimeError: the site's own bug" in record.getMessage()
    assert not record.exc_info and "\n" not in record.getMessage()


def test_the_traceback_comes_with_verbose(caplog):
    (record,) = _failed_records(caplog, logging.DEBUG)
    assert record.exc_info
