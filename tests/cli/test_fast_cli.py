"""`hydrafl --help` and the admin commands start without torch, Flower or matplotlib: each is checked in a fresh
interpreter on what it actually imported."""

from __future__ import annotations

import base64
import os

import import_probes
import pytest

HEAVY = (
    "torch",
    "matplotlib",
    "transformers",
    "peft",
    "flwr",
    "hydrafl.config",
    "hydrafl.server.aggregation.stability",
    "hydrafl.data",
)
"""What the command line loaded before it parsed its arguments, and must not load for these commands."""


def _run(args: list[str], env: dict[str, str]) -> tuple[int, set[str], str]:
    """Exit code, loaded modules and output of `hydrafl ARGS` in a fresh interpreter."""
    report, done = import_probes.cli(args, env)
    return report["code"], set(report["modules"]), done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        *(
            pytest.param([command, "--help"], marks=pytest.mark.slow)
            for command in ("admin", "site", "server")
        ),
    ],
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


def test_the_admin_issues_a_site_identity_certified_by_a_consortium_key_it_keeps(tmp_path):
    """`admin consortium create` then `admin site add --consortium-key`: the identity file is the site's (its
    node id), certified by that key, readable by its owner only; the coordinator's database holds no key."""
    from hydrafl.secagg import SiteIdentity
    from hydrafl.server.store import Store

    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path)}
    db = ["--db", f"sqlite:///{tmp_path / 'coordinator.db'}"]
    key, identity = tmp_path / "consortium.key", tmp_path / "st-marys.json"
    code, _, created = _run(["admin", "consortium", "create", str(key)], env)
    assert code == 0 and oct(key.stat().st_mode & 0o777) == "0o600"
    code, modules, _ = _run(
        [
            "admin",
            "site",
            "add",
            "st-marys",
            "--consortium-key",
            str(key),
            "--identity-out",
            str(identity),
            *db,
        ],
        env,
    )
    assert code == 0 and sorted(name for name in modules if name.startswith(HEAVY)) == []
    issued = SiteIdentity.from_json(
        identity.read_text()
    )  # checks its certificate against its consortium key
    assert issued.node == Store(f"sqlite:///{tmp_path / 'coordinator.db'}").sites()[0].node_id
    assert base64.b64encode(issued.consortium_key).decode() in created
    assert oct(identity.stat().st_mode & 0o777) == "0o600"
    code, _, _ = _run(
        ["admin", "site", "certify", "nobody", "--consortium-key", str(key), *db], env
    )
    assert code == 2  # no such site
