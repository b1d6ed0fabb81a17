"""`pip install .` (a real wheel, not the editable checkout) holds every sub-package under one namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from package_layout import ROOT, package_dirs


@pytest.mark.slow
def test_wheel_installs_every_subpackage_under_hydrafl(tmp_path):
    source = (
        tmp_path / "source"
    )  # a clean copy: a stale build/ folder would fill in what the package list lacks
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".*", "build", "dist", "*.egg-info", "__pycache__", "results", "runs", "hydrafl-runs"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("hydrafl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(
        set(_source_modules()) - names
    )  # e.g. a new sub-package not listed in pyproject
    assert not missing, (
        f"the wheel lacks {missing}: add their packages to [tool.setuptools] packages"
    )
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    probe = (  # the migration scripts are found where the wheel put them
        "import hydrafl.strategies, hydrafl.server, hydrafl.cli; from hydrafl.server.migrations import head_revision; "
        "head_revision(); print(hydrafl.strategies.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    assert done.stdout.strip().startswith(str(target))


def _source_modules() -> list[str]:
    """Every module of the checkout, as the path the wheel should hold it at (`hydrafl/...`)."""
    folders = {folder: package.replace(".", "/") for folder, package in package_dirs().items()}
    return [
        f"{installed}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, installed in folders.items()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    ]
