"""Imports point one way: strategies and the shared core never reach into the coordinator or the site agent."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_strategies_and_core_do_not_import_server_or_client():
    runtime = ("hydrafl.server.", "hydrafl.client.")
    checked = [*ROOT.joinpath("strategies").glob("*.py"), *ROOT.joinpath("hydrafl").rglob("*.py")]
    offenders = {
        str(path.relative_to(ROOT)): sorted(name for name in _imports(path) if f"{name}.".startswith(runtime))
        for path in checked
        if path.name != "cli.py"  # the command line is the one place that wires every runtime together
    }
    assert {path: names for path, names in offenders.items() if names} == {}
    assert len(checked) > 20


def test_the_site_agent_does_not_import_the_coordinator():
    for path in ROOT.joinpath("client").glob("*.py"):
        assert not [name for name in _imports(path) if f"{name}.".startswith("hydrafl.server.")], path


def test_the_coordinator_process_loads_no_model_code():
    """DESIGN.md: the coordinator handles named arrays only. Checked on what a real import pulls in."""
    probe = (
        "import sys, hydrafl.server.coordinator, hydrafl.cli\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split())
    model_code = ("transformers", "peft", "hydrafl.models", "hydrafl.model_zoo", "hydrafl.site_app", "hydrafl.training")
    assert "hydrafl.server_app" in loaded and "hydrafl.strategies.hydra" in loaded
    assert sorted(name for name in loaded if name.startswith(model_code)) == []
