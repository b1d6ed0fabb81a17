"""`hydrafl server`'s options become one CoordinatorConfig, validated before anything listens: a TOML file with
the flags' names as keys, flags over it, unknown keys and bad values refused by name, TLS files checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.server.config import DEFAULT_LISTEN, LEASE_STALE_S, CoordinatorConfig
from hydrafl.server.transport.tls import ServerTls
from hydrafl.validation import ConfigError


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "coordinator.toml"
    path.write_text(text)
    return path


def test_defaults_live_under_hydrafl_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRAFL_HOME", str(tmp_path))
    config = CoordinatorConfig.from_options({})
    assert (config.listen, config.home, config.tls) == (DEFAULT_LISTEN, tmp_path, None)
    assert config.lease_stale_s == LEASE_STALE_S
    assert config.db_url == f"sqlite:///{tmp_path / 'coordinator.db'}"
    assert (config.blob_dir, config.runs_dir) == (tmp_path / "blobs", tmp_path / "runs")
    assert config.transport == "no TLS"


def test_a_toml_file_is_read_and_flags_win_over_it(tmp_path):
    text = (
        'listen = "0.0.0.0:7000"\ndb = "sqlite:///x.db"\nblobs = "/srv/blobs"\n'
        "lease-stale-s = 12\nsend-cache-mb = 0\n"
    )
    config = CoordinatorConfig.load(_toml(tmp_path, text), {"listen": "127.0.0.1:7001"})
    assert (config.listen, config.db_url, config.blob_dir) == (
        "127.0.0.1:7001",
        "sqlite:///x.db",
        Path("/srv/blobs"),
    )
    assert config.lease_stale_s == 12 and config.send_cache_mb == 0


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            'lisen = "127.0.0.1:1"\n',
            "unknown key 'lisen' in .*coordinator.toml; valid keys: blobs, db, keep-checkpoints, lease-stale-s",
        ),
        ("listen = 9091\n", "key 'listen' in .*coordinator.toml must be a string, got 9091"),
        ("lease-stale-s = -1\n", "lease-stale-s must be a positive number of seconds, got -1"),
        (
            'lease-stale-s = "soon"\n',
            "lease-stale-s must be a positive number of seconds, got 'soon'",
        ),
        ("[server]\nlisten = 1\n", "unknown key 'server'.*tables are not supported"),
        ("send-cache-mb = -1\n", "send-cache-mb must be a whole number of MiB, 0 or more, got -1"),
        (
            "send-cache-mb = 1.5\n",
            "send-cache-mb must be a whole number of MiB, 0 or more, got 1.5",
        ),
    ],
)
def test_an_unknown_key_or_a_bad_value_is_refused_by_name(tmp_path, text, named):
    with pytest.raises(ConfigError, match=named):
        CoordinatorConfig.load(_toml(tmp_path, text), {})


def test_tls_options_are_checked_with_the_tls_type(tmp_path):
    cert, key, ca = (tmp_path / name for name in ("server.pem", "server.key", "ca.pem"))
    for path in (cert, key, ca):
        path.write_text("PEM")
    refused = {
        "TLS needs both --tls-cert and --tls-key": {"tls-cert": str(cert)},
        "--tls-client-ca \\(mutual TLS\\) needs --tls-cert and --tls-key": {
            "tls-client-ca": str(ca)
        },
        "--tls-key .*missing.key is not a file": {
            "tls-cert": str(cert),
            "tls-key": str(tmp_path / "missing.key"),
        },
    }
    for named, values in refused.items():
        with pytest.raises(ConfigError, match=named):
            CoordinatorConfig.from_options(values)
    mutual = CoordinatorConfig.from_options(
        {"tls-cert": str(cert), "tls-key": str(key), "tls-client-ca": str(ca)}
    )
    assert (
        mutual.tls == ServerTls(cert=cert, key=key, client_ca=ca)
        and mutual.transport == "mutual TLS"
    )


def test_the_server_command_refuses_a_bad_config_file_before_it_starts(tmp_path):
    result = CliRunner().invoke(app, ["server", "--config", str(_toml(tmp_path, "blob = 'x'\n"))])
    assert result.exit_code == 2 and "unknown key 'blob'" in " ".join(result.output.split())
    result = CliRunner().invoke(
        app, ["server", "--tls-cert", str(tmp_path / "none.pem"), "--tls-key", "k.pem"]
    )
    output = " ".join(result.output.split())
    assert (
        result.exit_code == 2
        and "error: --tls-cert" in output
        and "none.pem is not a file" in output
    )
