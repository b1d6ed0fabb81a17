"""A coordinator listening without TLS on anything but loopback warns loudly; loopback is told apart correctly."""

from __future__ import annotations

import logging

import pytest

from hydrafl.netaddr import is_loopback
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:9091", True),
        ("127.3.2.1:9091", True),
        ("localhost:9091", True),
        ("LOCALHOST", True),
        ("[::1]:9091", True),
        ("::1", True),
        ("0.0.0.0:9091", False),
        ("[::]:9091", False),
        ("10.1.2.3:9091", False),
        ("[fe80::1]:9091", False),
        ("coordinator.example.org:9091", False),
    ],
)
def test_only_loopback_addresses_are_loopback(address, loopback):
    assert is_loopback(address) is loopback


@pytest.mark.parametrize(("listen", "warns"), [("0.0.0.0:0", True), ("127.0.0.1:0", False)])
def test_a_plaintext_coordinator_on_the_network_warns(tmp_path, caplog, listen, warns):
    coordinator = Coordinator(
        CoordinatorConfig(
            listen=listen,
            db_url=f"sqlite:///{tmp_path / 'c.db'}",
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
        )
    )
    with caplog.at_level(logging.WARNING, logger="hydrafl.server.coordinator"):
        coordinator.start()
    coordinator.stop()
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "WITHOUT TLS" in r.getMessage()
    ]
    assert warnings == (
        [
            f"listening on {listen} WITHOUT TLS: site tokens and model updates cross the network in clear "
            "text; use --tls-cert/--tls-key, or listen on 127.0.0.1 behind a TLS-terminating proxy"
        ]
        if warns
        else []
    )
