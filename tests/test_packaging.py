"""`pip install .` (a real wheel, not the editable checkout) holds every sub-package under one namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_every_subpackage_under_hydrafl(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("hydrafl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("hydrafl/server/__init__.py", "hydrafl/client/__init__.py", "hydrafl/proto/__init__.py",
                   "hydrafl/strategies/diloco.py", "hydrafl/benchmarks/__init__.py", "hydrafl/data/__init__.py",
                   "hydrafl/cli/admin.py", "hydrafl/server/migrations/env.py",
                   "hydrafl/server/migrations/versions/0001_initial.py"):
        assert module in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    probe = (  # the migration scripts are found where the wheel put them
        "import hydrafl.strategies, hydrafl.server, hydrafl.cli; from hydrafl.server.migrations import head_revision; "
        "head_revision(); print(hydrafl.strategies.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert done.stdout.strip().startswith(str(target))
