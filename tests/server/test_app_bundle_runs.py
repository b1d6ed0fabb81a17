"""A quickstart-style Flower app project (tests/assets/quickapp_project: pyproject components and config, FedAvg,
the Message API) run three ways: in-process, and as an app bundle `hydrafl admin run create --app` ships to two
`hydrafl site` processes that allow its digest, which give the in-process numbers, and to a third that does
not, which refuses every message of the run and goes on serving."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deployment import free_port, start_hydrafl, wait_joined, wait_serving, wait_until
from flwr.supercore.object_ref import load_app

from hydrafl.app_bundle import BundleError, importable, load_bundle, missing_dependencies, unpack
from hydrafl.client.site_policy import SitePolicy
from hydrafl.server.store import Store
from hydrafl.simulation import run_app

PROJECT = Path(__file__).resolve().parents[1] / "assets" / "quickapp_project"


def _in_process(result: Path) -> dict:
    bundle = load_bundle(PROJECT)
    with importable(PROJECT, bundle.server_app, bundle.client_app):
        server_app = load_app(bundle.server_app, ValueError)
        client_app = load_app(bundle.client_app, ValueError)
    run_config = {**bundle.config, "result-path": str(result)}
    run_app(server_app, client_app, num_sites=2, run_config=run_config)
    return json.loads(result.read_text())


@pytest.mark.slow
def test_a_flower_app_bundle_runs_on_the_sites_that_allow_its_digest(tmp_path):
    expected = _in_process(tmp_path / "in-process.json")
    digest = load_bundle(PROJECT).digest
    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path / "home")}
    db, address = f"sqlite:///{tmp_path / 'c.db'}", f"127.0.0.1:{free_port()}"
    store = Store(db)
    tokens = [store.add_site(name)[1] for name in ("a", "b", "refusing")]
    server = ("server", "--listen", address, "--db", db, "--blobs", str(tmp_path / "blobs"))
    processes = [start_hydrafl(*server, env=env, log=tmp_path / "coordinator.log")]
    try:
        wait_serving(address, process=processes[0])
        for index, token in enumerate(tokens):
            allowed = ("--allow-app", digest) if index < 2 else ()
            node_config = f"partition-id={index} num-partitions=2"
            site = ("site", "--coordinator", address, "--token", token, *allowed)
            processes.append(
                start_hydrafl(
                    *site, "--node-config", node_config, env=env, log=tmp_path / f"site-{index}.log"
                )
            )
        # Flower's FedAvg fixes a round's sample size before it waits for min-nodes: all three sites are
        # connected before the run is queued, so every round asks all three
        wait_joined([tmp_path / f"site-{i}.log" for i in range(3)])
        result = tmp_path / "deployed.json"
        created = subprocess.run(
            [sys.executable, "-m", "hydrafl", "admin", "run", "create", "--app", str(PROJECT)]
            + ["--run-config", f'min-nodes=3 result-path="{result}"', "--db", db],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert created.returncode == 0, created.stderr
        assert f"--allow-app {digest}" in " ".join(created.stderr.split())
        run_id = int(created.stdout.split()[-1])
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"), 180, "the run did not end"
        )
        run = store.run(run_id)
        assert run.status == "finished", run.detail
        deployed = json.loads(result.read_text())
        assert deployed["weights"] == pytest.approx(expected["weights"], rel=1e-6)
        for kind in ("train", "evaluate"):
            assert deployed[kind].keys() == expected[kind].keys() == {"1", "2", "3"}
            for server_round, metrics in expected[kind].items():
                assert deployed[kind][server_round] == pytest.approx(metrics, rel=1e-6)
        rounds = zip(
            run.history, expected["train"].values(), expected["evaluate"].values(), strict=True
        )
        for record, train, evaluate in rounds:
            assert record["sites_ok"] == 2 and record["sites_failed"] == 2  # train, evaluate
            assert record["train_loss"] == pytest.approx(train["train_loss"], rel=1e-6)
            assert record["loss"] == pytest.approx(evaluate["eval_loss"], rel=1e-6)
        assert len(run.history) == 3
        refusals = [e for e in store.run_events(run_id, ("site-declined",)) if e.site_name]
        assert {event.site_name for event in refusals} == {"refusing"}
        assert all(f"does not allow app bundle sha256:{digest}" in e.detail for e in refusals)
        assert processes[-1].poll() is None  # the refusing site goes on serving
        assert (tmp_path / "home" / "runs" / str(run_id) / "app" / "quickapp").is_dir()
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _zip(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ({"../escape.py": b"x"}, "outside its folder"),
        ({"/etc/passwd": b"x"}, "outside its folder"),
        ({f"f{i}.py": b"" for i in range(2_001)}, "at most 2000"),
        ({"big.bin": b"\0" * (65 << 20)}, "unpacks to over"),
    ],
    ids=["dot-dot", "absolute", "too-many-files", "too-large"],
)
def test_a_bundle_is_unpacked_only_inside_its_folder_and_size_bounded(tmp_path, entries, reason):
    with pytest.raises(BundleError, match=reason):
        unpack(_zip(entries), tmp_path / "app")
    assert not (tmp_path / "app").exists() and not (tmp_path / "escape.py").exists()


def test_dependencies_are_checked_not_installed(tmp_path):
    folder = unpack(load_bundle(PROJECT).data, tmp_path / "app")
    assert missing_dependencies(folder) == []
    pyproject = folder / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace(
            '"numpy>=1.26",', '"numpy>=1.26", "numpy<1", "no-such-package-hydrafl>=1",'
        )
    )
    missing = missing_dependencies(folder)
    assert [entry.split(" (")[0] for entry in missing] == ["numpy<1", "no-such-package-hydrafl>=1"]
    assert "installed)" in missing[0] and missing[1].endswith("(not installed)")


def test_a_site_refuses_a_bundle_its_policy_does_not_list():
    digest = load_bundle(PROJECT).digest
    assert SitePolicy(allowed_apps=(digest,)).app_refusal(digest) == ""
    refusal = SitePolicy().app_refusal(digest)
    assert digest in refusal and f"--allow-app {digest}" in refusal


def test_a_fab_that_flwr_build_made_is_the_same_bundle_as_its_project(tmp_path):
    built = load_bundle(PROJECT)
    fab = tmp_path / "quickapp.fab"
    fab.write_bytes(built.data)
    assert load_bundle(fab) == built
    assert (built.server_app, built.client_app) == (
        "quickapp.server_app:app",
        "quickapp.client_app:app",
    )
    assert built.config == {"num-server-rounds": 3, "lr": 0.25, "min-nodes": 2}


def test_run_create_refuses_what_is_not_a_flower_app_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from hydrafl.cli import app

    (tmp_path / "empty").mkdir()
    (tmp_path / "x.fab").write_bytes(b"not a zip")
    db = f"sqlite:///{tmp_path / 'c.db'}"
    for path, reason in [("empty", "has no pyproject.toml"), ("x.fab", "not a Flower app bundle")]:
        done = CliRunner().invoke(
            app, ["admin", "run", "create", "--app", str(tmp_path / path), "--db", db]
        )
        assert done.exit_code == 2 and reason in " ".join(done.output.split())
    assert not (tmp_path / "c.db").exists()  # refused before anything is written


def test_loading_a_bundle_reimports_only_the_packages_it_holds(tmp_path):
    import hydrafl.app_bundle as before

    folder = unpack(load_bundle(PROJECT).data, tmp_path / "app")
    with importable(folder, "quickapp.client_app:app", "hydrafl.app_bundle:AppBundle"):
        first = load_app("quickapp.client_app:app", ValueError)
    with importable(folder, "quickapp.client_app:app", "hydrafl.app_bundle:AppBundle"):
        second = load_app("quickapp.client_app:app", ValueError)
    assert first is not second  # the second run's bundle, not the first's module
    assert sys.modules["hydrafl.app_bundle"] is before
    assert str(folder) not in sys.path
