"""`hydrafl site` settles what it can before it connects (its token, its own data, its policy file) and warns
before it sends its token in clear text off this machine. Its coordinator here is a real gRPC server on
loopback that records the token and refuses it, so a site that gets as far as connecting exits 3 at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_coordinator import FakeCoordinator
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.netaddr import is_loopback

TESTS = Path(__file__).resolve().parents[1]
STOCK_APP = ["--app", "stock_flower_app:client_app"]
PS_WARNING = "visible to every user of this machine in `ps`"
TOKEN_ENV = {"HYDRAFL_SITE_TOKEN": "s3cret-token"}


@pytest.fixture
def refusing(monkeypatch):
    monkeypatch.delenv("HYDRAFL_SITE_TOKEN", raising=False)
    coordinator = FakeCoordinator(refuse=True)
    server = coordinator.start()
    yield coordinator
    server.stop(grace=None)


def _site(coordinator: FakeCoordinator, *args: str, env: dict | None = None):
    result = CliRunner().invoke(
        app, ["site", "--coordinator", coordinator.address, *STOCK_APP, *args], env=env
    )
    return result, " ".join(result.output.split())


def test_the_token_comes_from_one_source_and_a_token_on_the_command_line_warns(tmp_path, refusing):
    token_file = tmp_path / "site.token"
    token_file.write_text("  s3cret-token\n")
    result, output = _site(refusing, "--token-file", str(token_file))
    assert result.exit_code == 3 and PS_WARNING not in output
    result, output = _site(refusing, env={"HYDRAFL_SITE_TOKEN": "env-token"})
    assert result.exit_code == 3 and PS_WARNING not in output
    result, output = _site(refusing, "--token", "typed-token")
    assert result.exit_code == 3 and PS_WARNING in output
    assert refusing.joins == ["Bearer s3cret-token", "Bearer env-token", "Bearer typed-token"]

    (tmp_path / "empty.token").write_text(" \n")
    refused = {
        "give the token one way: --token-file or --token, not both": [
            "--token-file",
            str(token_file),
            "--token",
            "t",
        ],
        "cannot read --token-file": ["--token-file", str(tmp_path / "missing.token")],
        "Is a directory": ["--token-file", str(tmp_path)],
        "is empty": ["--token-file", str(tmp_path / "empty.token")],
        "a site needs its token": [],
    }
    for reason, args in refused.items():
        result, output = _site(refusing, *args)
        assert result.exit_code == 2 and reason in output, (args, output)
    result, output = _site(
        refusing, "--token-file", str(token_file), env={"HYDRAFL_SITE_TOKEN": "env-token"}
    )
    assert result.exit_code == 2 and "--token-file or $HYDRAFL_SITE_TOKEN, not both" in output
    assert len(refusing.joins) == 3  # none of them connected


def test_a_wrong_label_column_stops_the_site_before_it_connects(tmp_path, refusing):
    data = tmp_path / "visits.csv"
    rows = "".join(f"{i},{i / 10},{'icu' if i % 2 else 'ward'}\n" for i in range(12))
    data.write_text(f"age,lactate,outcome\n{rows}")
    result, output = _site(
        refusing, "--data", str(data), "--label-column", "diagnosis", env=TOKEN_ENV
    )
    assert result.exit_code == 2
    assert (
        "there is no column 'diagnosis'; available columns: 'age', 'lactate', 'outcome'" in output
    )
    assert refusing.joins == []
    result, _ = _site(refusing, "--data", str(data), "--label-column", "outcome", env=TOKEN_ENV)
    assert result.exit_code == 3 and len(refusing.joins) == 1  # its own data is fine: it connects


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "cannot be read: Is a directory"), (b"\xff\xfe\x00 binary", "is not UTF-8 text")],
    ids=["a directory", "not text"],
)
def test_an_unreadable_policy_file_is_a_one_line_error_before_connecting(
    tmp_path, refusing, content, reason
):
    policy = tmp_path / "policy"
    if content is None:
        policy.mkdir()
    else:
        policy.write_bytes(content)
    result, output = _site(refusing, "--policy", str(policy), env=TOKEN_ENV)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert (
        "invalid site policy, not starting" in output
        and reason in output
        and "Traceback" not in output
    )
    assert refusing.joins == []


def test_is_loopback():
    for address in (
        "127.0.0.1:9091",
        "127.8.9.10:1",
        "localhost:9091",
        "LocalHost",
        "[::1]:9091",
        "::1",
        "ipv4:127.0.0.1:50051",
        "dns:///localhost:80",
        "unix:/run/hydrafl.sock",
    ):
        assert is_loopback(address), address
    for address in (
        "10.255.255.1:9",
        "0.0.0.0:9091",
        "[::]:9091",
        "coordinator.example.org:9091",
        "192.168.1.20",
        "[2001:db8::1]:443",
        "localhost.example.org:1",
        "",
    ):
        assert not is_loopback(address), address


def test_a_site_on_this_machine_sends_its_token_without_a_clear_text_warning(refusing):
    result, output = _site(refusing, env=TOKEN_ENV)
    assert result.exit_code == 3 and refusing.joins == [
        "Bearer s3cret-token"
    ]  # it got as far as sending it
    assert "without TLS" not in output  # loopback: a test on one machine


@pytest.mark.slow
def test_a_site_warns_before_it_sends_its_token_in_clear_text_off_this_machine():
    command = [
        sys.executable,
        "-m",
        "hydrafl",
        "site",
        "--coordinator",
        "10.255.255.1:9",
        *STOCK_APP,
    ]
    python_path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **TOKEN_ENV, "PYTHONPATH": python_path, "COLUMNS": "400"}
    site = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []

    def read() -> None:
        for line in site.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while (
            "--tls-ca" not in "".join(lines) and site.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.1)
    finally:
        site.terminate()
        site.wait(timeout=10)
        reader.join(timeout=10)
    warning = " ".join("".join(lines).split())
    assert (
        "warning: connecting to 10.255.255.1:9 without TLS" in warning
        and "pass --tls-ca" in warning
    )


def test_an_allow_app_that_is_not_a_digest_stops_the_site_before_it_connects(refusing):
    result, output = _site(refusing, "--allow-app", "latest", env=TOKEN_ENV)
    assert result.exit_code == 2 and "'latest' is not a SHA-256 digest" in output
    assert refusing.joins == []
