"""Where a coordinator keeps its state when not told otherwise."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """$HYDRAFL_HOME, else ~/.hydrafl: one folder holding the SQLite database and the blob store."""
    return Path(os.environ.get("HYDRAFL_HOME", Path.home() / ".hydrafl"))


def default_db_url() -> str:
    return f"sqlite:///{data_dir() / 'coordinator.db'}"


def default_blob_dir() -> Path:
    return data_dir() / "blobs"
