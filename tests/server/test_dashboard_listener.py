"""The dashboard's listener has limits, and nothing that reaches them reaches the coordinator: idle and slow
connections are dropped, connections over the cap are closed at once, and a real `hydrafl server --dashboard`
at 1,024 descriptors outlives 1,100 idle connections with its health check, its runs and its dashboard intact."""

from __future__ import annotations

import resource
import socket
import statistics
import subprocess
import sys
import time

import grpc
import pytest
from dashboard_http import fetch
from deployment import enrol, free_port, queue_run, start_hydrafl, wait_serving, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import SMALL_RUN

from hydrafl.benchmarks._reliability_cluster import set_limits
from hydrafl.benchmarks._reliability_sockets import (
    descriptors,
    descriptors_raised,
    idlers,
    limit_descriptors,
)
from hydrafl.server.dashboard import Dashboard, DashboardConfig
from hydrafl.server.store import Store

TOKEN = "dashboard-token-for-tests-0123456789"
IDLE_CONNECTIONS = 1_100
DESCRIPTORS = 1_024


def _closed_within(conn: socket.socket, timeout_s: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed `conn` (sending `trickle` a byte at a time meanwhile), or None."""
    start = time.monotonic()
    conn.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < timeout_s:
        if sent < len(trickle):
            try:
                conn.sendall(trickle[sent : sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
        try:
            data = conn.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
        if not data or data.startswith(b"HTTP/1.0 408"):
            return time.monotonic() - start
    return None


@pytest.fixture
def board(tmp_path):
    config = DashboardConfig(
        listen="127.0.0.1:0", token=TOKEN, max_connections=8, workers=2, request_timeout_s=2.0
    )
    dashboard = Dashboard(config, Store(f"sqlite:///{tmp_path / 'c.db'}"), tmp_path / "runs")
    dashboard.start()
    yield dashboard
    dashboard.stop()


def test_idle_slow_and_surplus_connections_are_dropped_and_real_requests_still_served(board):
    host, port = board.server.server_address[:2]
    idle = socket.create_connection((host, port))
    assert _closed_within(idle, 4.0) == pytest.approx(2.0, abs=0.6)  # never sent a byte
    # a byte every 0.2 s keeps every read short; the request's deadline still drops it
    slow = socket.create_connection((host, port))
    trickled_s = _closed_within(
        slow, 4.0, trickle=b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    )
    assert trickled_s is not None and 1.4 < trickled_s < 2.8, trickled_s
    idle.close(), slow.close()

    held = [socket.create_connection((host, port)) for _ in range(7)]
    time.sleep(
        0.3
    )  # seven idle connections hold no worker: a real request beside them is answered at once
    start = time.monotonic()
    assert fetch(f"{board.url}/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert time.monotonic() - start < 0.9
    held.append(socket.create_connection((host, port)))
    time.sleep(0.3)
    surplus = [socket.create_connection((host, port)) for _ in range(20)]
    assert all(
        _closed_within(conn, 0.5) is not None for conn in surplus
    )  # over the cap: closed at once
    assert board.open_connections() <= 8
    for conn in held + surplus:
        conn.close()
    wait_until(lambda: board.open_connections() == 0, 5, "closed connections were not forgotten")
    status, _, body = fetch(f"{board.url}/metrics", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and "hydrafl" in body
    assert fetch(f"{board.url}/metrics")[0] == 401


def test_the_dashboard_refuses_limits_that_are_not_positive():
    for bad in (
        {"max_connections": 0},
        {"workers": 0},
        {"request_timeout_s": 0.0},
        {"request_timeout_s": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad)).replace("_", "-")):
            DashboardConfig(listen="127.0.0.1:0", token=TOKEN, **bad)


@pytest.mark.slow
def test_a_coordinator_at_1024_descriptors_outlives_1100_idle_connections_to_each_listener(
    tmp_path,
):
    with descriptors_raised(IDLE_CONNECTIONS + 200) as raised:
        if not raised:
            pytest.skip(f"this test process may not open {IDLE_CONNECTIONS + 200} descriptors")
        cfg = SMALL_RUN.replace(sites=2, rounds=2)
        env, db, store, tokens, address = enrol(tmp_path, cfg)
        board_port = free_port()
        with (tmp_path / "coordinator.log").open("a") as log:
            coordinator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hydrafl",
                    "server",
                    "--listen",
                    address,
                    "--db",
                    db,
                    "--blobs",
                    str(tmp_path / "blobs"),
                    "--dashboard",
                    str(board_port),
                    "-v",
                ],
                env={**env, "HYDRAFL_DASHBOARD_TOKEN": TOKEN},
                stdout=log,
                stderr=log,
            )
            set_limits(coordinator, limit_descriptors(DESCRIPTORS))
        processes = [coordinator]
        idle: list[socket.socket] = []
        try:
            wait_serving(address, process=coordinator)
            url = f"http://127.0.0.1:{board_port}"
            wait_until(
                lambda: fetch(f"{url}/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == 200,
                30,
                "no dashboard",
            )
            assert resource.prlimit(coordinator.pid, resource.RLIMIT_NOFILE) == (
                DESCRIPTORS,
                DESCRIPTORS,
            )
            idle = idlers(board_port, coordinator.pid, IDLE_CONNECTIONS, DESCRIPTORS)
            print(
                f"\ncoordinator descriptors {descriptors(coordinator.pid, DESCRIPTORS)} after the idle connections"
            )
            run_id = queue_run(
                store, cfg
            )  # the coordinator starts it during the attack: imports, files, database
            latencies, peak = [], 0
            with grpc.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                deadline = time.monotonic() + 8
                while time.monotonic() < deadline:
                    start = time.monotonic()
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    latencies.append(time.monotonic() - start)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    peak = max(peak, descriptors(coordinator.pid, DESCRIPTORS))
                    time.sleep(0.25)
            assert coordinator.poll() is None, (tmp_path / "coordinator.log").read_text()[-3000:]
            wait_serving(
                address, timeout_s=10, process=coordinator
            )  # a new connection gets a descriptor too
            assert peak < DESCRIPTORS - 200, peak
            assert store.run(run_id).status in ("pending", "running"), store.run(run_id).detail
            print(
                f"\ncoordinator descriptors at most {peak} during {len(idle)} idle connections; health check "
                f"median {statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
            )
            for conn in idle:
                conn.close()
            # the same on the sites' port: gRPC closes connections over its cap, the health check keeps answering
            idle = idlers(
                int(address.rsplit(":", 1)[1]), coordinator.pid, IDLE_CONNECTIONS, DESCRIPTORS
            )
            with grpc.insecure_channel(
                address
            ) as channel:  # opened before: the cap refuses new connections
                health = health_pb2_grpc.HealthStub(channel)
                grpc_latencies, grpc_peak = [], 0
                for _ in range(10):
                    start = time.monotonic()
                    assert (
                        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                        == 1
                    )
                    grpc_latencies.append(time.monotonic() - start)
                    grpc_peak = max(grpc_peak, descriptors(coordinator.pid, DESCRIPTORS))
                    time.sleep(0.25)
            assert coordinator.poll() is None and grpc_peak < DESCRIPTORS - 200, grpc_peak
            print(
                f"gRPC port: coordinator descriptors at most {grpc_peak} during {len(idle)} idle connections; "
                f"health check median {statistics.median(grpc_latencies) * 1e3:.1f} ms"
            )
            for conn in idle:
                conn.close()
            idle = []
            wait_serving(address, timeout_s=20, process=coordinator)
            for i, token in enumerate(tokens):
                processes.append(
                    start_hydrafl(
                        "site",
                        "--coordinator",
                        address,
                        "--token",
                        token,
                        env=env,
                        log=tmp_path / f"site-{i}.log",
                    )
                )
            wait_until(
                lambda: store.run(run_id).status in ("finished", "failed"),
                240,
                "the run did not finish",
            )
            assert store.run(run_id).status == "finished", store.run(run_id).detail
            status, _, page = fetch(f"{url}/", {"Authorization": f"Bearer {TOKEN}"})
            assert status == 200 and f"run {run_id}" in page.lower()
            assert coordinator.poll() is None
        finally:
            for conn in idle:
                conn.close()
            for process in processes:
                process.kill()
                process.wait()
