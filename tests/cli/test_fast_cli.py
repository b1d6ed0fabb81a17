"""`hydrafl --help` and the admin commands start without torch, Flower or matplotlib: each is checked in a fresh
interpreter on what it actually imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "matplotlib", "transformers", "peft", "flwr", "hydrafl.config", "hydrafl.stability", "hydrafl.data")
"""What the command line loaded before it parsed its arguments, and must not load for these commands."""
PROBE = """
import json, sys
from hydrafl.cli import main
sys.argv = ["hydrafl", *json.loads(sys.argv[1])]
code = 0
try:
    main()
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _run(args: list[str], env: dict[str, str]) -> tuple[int, set[str], str]:
    """Exit code, loaded modules and output of `hydrafl ARGS` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["code"], set(report["modules"]), done.stdout


@pytest.mark.parametrize(
    "args",
    [["--help"], *(pytest.param([command, "--help"], marks=pytest.mark.slow)
                   for command in ("admin", "site", "server"))],
)
def test_help_loads_no_model_or_flower_code(args, tmp_path):
    code, modules, output = _run(args, {**os.environ, "HYDRAFL_HOME": str(tmp_path)})
    assert code == 0 and "Usage" in output
    assert sorted(name for name in modules if name.startswith(HEAVY)) == []


def test_admin_site_commands_load_only_the_database(tmp_path):
    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path)}
    db = ["--db", f"sqlite:///{tmp_path / 'coordinator.db'}"]
    for args in (["admin", "site", "add", "st-marys", *db], ["admin", "site", "list", *db]):
        code, modules, output = _run(args, env)
        assert code == 0
        assert "sqlalchemy" in modules
        assert sorted(name for name in modules if name.startswith(HEAVY)) == []
    assert "st-marys" in output and "active" in output
