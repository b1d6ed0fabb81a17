"""Shared fixtures and hooks: a small, fast federation config, and the import-graph probes started early."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import pytest
import torch

from hydrafl.config import RunConfig

torch.set_num_threads(1)


@pytest.fixture
def small_run(tmp_path) -> RunConfig:
    """Three sites, tiny cohort, a few rounds: a real federation that runs in a few seconds (`helpers.SMALL_RUN`),
    writing its run directory under the test's tmp_path."""
    from helpers import (
        SMALL_RUN,
    )  # the message builders it sits with import the model code: only when asked

    return SMALL_RUN.replace(run_dir=str(tmp_path / "run"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session that runs the import-graph tests starts their fresh-interpreter probes now, so they import the
    whole stack in the background while the tests before them run."""
    if any(item.path.name == "test_import_graph.py" for item in session.items):
        import import_probes

        import_probes.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    import_probes = sys.modules.get("import_probes")
    if import_probes is not None:
        import_probes.stop()
