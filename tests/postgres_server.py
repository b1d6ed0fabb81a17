"""A throwaway PostgreSQL server on loopback for tests (the real thing, as a hospital would run it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator


def _as_postgres(command: list[str]) -> list[str]:
    """initdb refuses to run as root: run it as the postgres user when we are root."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a private cluster; yields its SQLAlchemy URL. Needs PostgreSQL's initdb/pg_ctl on PATH."""
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        raise RuntimeError(
            "PostgreSQL server binaries (initdb, pg_ctl) are not installed; .ci/run installs them"
        )
    folder = tempfile.mkdtemp(prefix="hydrafl-pg-", dir="/tmp")
    os.chmod(folder, 0o755)
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
    data = os.path.join(folder, "data")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    subprocess.run(
        _as_postgres(["initdb", "-D", data, "-A", "trust", "-U", "postgres"]),
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        _as_postgres(
            ["pg_ctl", "-D", data, "-o", options, "-w", "-l", os.path.join(folder, "log"), "start"]
        ),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_postgres(["pg_ctl", "-D", data, "-m", "immediate", "stop"]), capture_output=True
        )
        shutil.rmtree(folder, ignore_errors=True)
