"""A site's TLS files are checked with the TLS type, before the site connects: incomplete sets and missing files
are refused by flag, and a clear-text connection off this machine is named."""

from __future__ import annotations

import pytest
from fake_coordinator import FakeCoordinator
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.client.tls import MUTUAL_TLS_NEEDS, SiteTls, plaintext_warning
from hydrafl.validation import ConfigError


@pytest.fixture
def pem(tmp_path):
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("PEM")
    return files


def test_incomplete_or_missing_tls_files_are_refused_by_flag(pem, tmp_path):
    assert SiteTls.from_options(None, None, None) is None
    ca, cert, key = pem["ca"], pem["cert"], pem["key"]
    for incomplete in ((None, cert, key), (ca, cert, None), (ca, None, key)):
        with pytest.raises(ConfigError, match=MUTUAL_TLS_NEEDS):
            SiteTls.from_options(*incomplete)
    with pytest.raises(ConfigError, match="--tls-ca .*missing.pem is not a file"):
        SiteTls.from_options(tmp_path / "missing.pem", None, None)
    assert SiteTls.from_options(ca, cert, key) == SiteTls(ca=ca, cert=cert, key=key)


def test_only_clear_text_off_this_machine_is_warned_about(pem):
    assert plaintext_warning("127.0.0.1:9091", None) is None
    assert plaintext_warning("10.0.0.5:9091", SiteTls(ca=pem["ca"])) is None
    assert "connecting to 10.0.0.5:9091 without TLS" in plaintext_warning("10.0.0.5:9091", None)


def test_the_site_command_refuses_a_missing_ca_before_it_connects(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRAFL_SITE_TOKEN", "t")
    coordinator = FakeCoordinator(refuse=True)
    server = coordinator.start()
    try:
        result = CliRunner().invoke(
            app,
            [
                "site",
                "--coordinator",
                coordinator.address,
                "--app",
                "stock_flower_app:client_app",
                "--tls-ca",
                str(tmp_path / "ca.pem"),
            ],
        )
    finally:
        server.stop(grace=None)
    assert result.exit_code == 2 and "is not a file" in " ".join(result.output.split())
    assert coordinator.joins == []
