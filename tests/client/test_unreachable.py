"""A wrong --coordinator says what is wrong: a name that does not resolve ends the site at once (exit 2, the
flag named), nothing listening on the port is retried with that reason, a port that is not gRPC is told apart."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from hydrafl.netaddr import unreachable_reason

SITE = [sys.executable, "-m", "hydrafl", "site", "--token", "t0k3n"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_reasons_for_each_kind_of_wrong_address():
    reason, waiting_helps = unreachable_reason("no-such-host.invalid:9092")
    assert (
        reason.startswith("the host name 'no-such-host.invalid' does not resolve")
        and not waiting_helps
    )
    port = _free_port()
    assert unreachable_reason(f"127.0.0.1:{port}") == (
        f"nothing listens on 127.0.0.1:{port} (connection refused); is `hydrafl server` running there?",
        True,
    )
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert unreachable_reason(address) == (
            f"{address} accepts connections but does not answer gRPC (TLS on one side only?)",
            True,
        )
    assert unreachable_reason("coordinator.example") == (
        "'coordinator.example' is not HOST:PORT",
        False,
    )


def test_a_site_with_an_unresolvable_coordinator_stops_at_once_naming_the_flag():
    started = time.monotonic()
    done = subprocess.run(
        [*SITE, "--coordinator", "no-such-host.invalid:9092"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and time.monotonic() - started < 60
    assert (
        "error: cannot reach the coordinator: the host name 'no-such-host.invalid' does not resolve"
        in done.stderr
    )
    assert "check --coordinator" in done.stderr and "Traceback" not in done.stderr


def test_a_site_keeps_retrying_a_closed_port_and_says_nothing_listens_there(tmp_path):
    port = _free_port()
    log = tmp_path / "site.log"
    with log.open("w") as out:
        site = subprocess.Popen(
            [*SITE, "--coordinator", f"127.0.0.1:{port}"], stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 90
        while (
            "nothing listens" not in log.read_text()
            and time.monotonic() < deadline
            and site.poll() is None
        ):
            time.sleep(0.2)
        text = " ".join(log.read_text().split())
        assert site.poll() is None, text  # still waiting for the coordinator to come up
        assert (
            f"coordinator unreachable: nothing listens on 127.0.0.1:{port} (connection refused)"
            in text
        )
        assert "check --coordinator" in text
    finally:
        site.kill()
        site.wait()
