"""Imports point one way: strategies and the shared core never reach into the coordinator or the site agent,
the coordinator loads no model code, no module imports itself back through others, and files stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import import_probes
from package_layout import ROOT, package_dirs

PACKAGES = package_dirs()
WIRING = ("cli", "simulation", "apps.py")
"""The shared modules that wire both sides together: the command line, the simulation and the apps' one name."""
GENERATED = ("_pb2.py", "_pb2_grpc.py")

MODEL_CODE = (
    "transformers",
    "peft",
    "matplotlib",
    "hydrafl.models",
    "hydrafl.causal_lm",
    "hydrafl.backbones",
    "hydrafl.client.site_app",
    "hydrafl.client.training",
    "hydrafl.footprint",
    "hydrafl.losses",
    "hydrafl.data",
    "hydrafl.kernels",
    "hydrafl.subnet.apply",
    "hydrafl.subnet.architecture",
    "hydrafl.subnet.scoring",
    "hydrafl.subnet.measure",
    "hydrafl.export",
)
"""Site-side code: nn.Module models and what trains, scores or measures them, the cohorts, the kernels, plots."""


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    parts = [PACKAGES[relative.parts[0]], *relative.with_suffix("").parts[1:]]
    return ".".join(part for part in parts if part != "__init__")


def _sources() -> list[Path]:
    return [
        path
        for folder in PACKAGES
        for path in ROOT.joinpath(folder).rglob("*.py")
        if not path.name.endswith(GENERATED)
    ]


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Imported module names; with `top_level_only`, those a module runs when it is imported (not the ones
    inside functions or under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_strategies_and_core_do_not_import_server_or_client():
    runtime = ("hydrafl.server.", "hydrafl.client.")
    checked = [*ROOT.joinpath("strategies").glob("*.py"), *ROOT.joinpath("hydrafl").rglob("*.py")]
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in _imports(path) if f"{name}.".startswith(runtime)
        )
        for path in checked
        if not set(path.relative_to(ROOT).parts) & set(WIRING)
    }
    assert {path: names for path, names in offenders.items() if names} == {}
    assert len(checked) > 20


SITE_HALF_BASES = ("hydrafl.strategies.registry", "hydrafl.strategies.site")
"""All a site half may import of the strategies package (`strategies/site.py`)."""


def _site_halves() -> list[Path]:
    return [
        path for path in ROOT.joinpath("strategies").glob("*.py") if path.stem.endswith("_site")
    ]


def test_strategies_import_no_site_or_model_code():
    forbidden = ("hydrafl.server", "hydrafl.client", "hydrafl.client.site_app", *MODEL_CODE)
    offenders = {
        path.name: sorted(name for name in _imports(path) if name.startswith(forbidden))
        for path in ROOT.joinpath("strategies").glob("*.py")
        if path not in _site_halves()
    }
    assert {name: names for name, names in offenders.items() if names} == {}


def test_site_halves_import_no_coordinator_code_and_model_code_only_in_their_hooks():
    """A site imports only its run's strategy's site half, and the coordinator imports it too (to read what
    its replies carry), so it reaches neither side's runtime and loads model code only when a hook runs."""
    forbidden = ("hydrafl.server", "hydrafl.client", "flwr.serverapp", "flwr.server")
    halves = _site_halves()
    assert {"fedprox_site", "lora_site", "subnet_site"} <= {path.stem for path in halves}
    for path in halves:
        strategies = {n for n in _imports(path) if n.startswith("hydrafl.strategies.")}
        assert not [n for n in _imports(path) if n.startswith(forbidden)], path
        assert {n.rpartition(".")[0] if n not in SITE_HALF_BASES else n for n in strategies} <= {
            *SITE_HALF_BASES,
            "hydrafl.strategies",
        }, path
        top = _imports(path, top_level_only=True)
        assert not [n for n in top if n.startswith(MODEL_CODE)], path


def test_the_site_app_imports_only_the_site_half_contract_and_the_agent_not_the_coordinator():
    assert {
        name.rpartition(".")[0] if name.count(".") > 2 else name
        for name in _imports(ROOT / "client" / "site_app.py")
        if name.startswith("hydrafl.strategies")
    } <= set(SITE_HALF_BASES)
    loaded = import_probes.loaded("site")
    assert [name for name in loaded if name.startswith("hydrafl.strategies.")] == sorted(
        SITE_HALF_BASES
    )
    for path in ROOT.joinpath("client").glob("*.py"):
        assert not [name for name in _imports(path) if f"{name}.".startswith("hydrafl.server.")], (
            path
        )


def test_no_import_cycle_among_the_modules_loaded_at_import_time():
    modules = {_module_name(path): path for path in _sources()}
    graph = {
        name: {
            imported
            for imported in _imports(path, top_level_only=True)
            if imported in modules and imported != name
        }
        for name, path in modules.items()
    }
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> list[str]:
        state[name] = "open"
        for child in sorted(graph[name]):
            if state.get(child) == "open":
                return [*trail, name, child]
            if child not in state and (cycle := visit(child, [*trail, name])):
                return cycle
        state[name] = "done"
        return []

    cycles = [cycle for name in sorted(graph) if name not in state and (cycle := visit(name, []))]
    assert cycles == []


def test_no_source_file_is_over_500_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in _sources()
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


def test_the_coordinator_process_loads_no_model_code():
    """The coordinator handles named arrays only (README, Layout). Checked on what a real import pulls in: the
    coordinator, the ServerApp it runs with every strategy loaded, and the CLI's server and admin commands."""
    modules = set(import_probes.loaded("coordinator"))
    assert {
        "hydrafl.server.server_app",
        "hydrafl.strategies.hydra",
        "hydrafl.strategies.flora",
    } <= modules
    assert sorted(name for name in modules if name.startswith(MODEL_CODE)) == []
