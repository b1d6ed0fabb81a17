"""What an attack on a listener measures and plays: a process's descriptors and the connections it holds
(from /proc), connections that never send a byte or send one every 0.2 s, and a gRPC health probe."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydrafl.benchmarks._reliability_cluster import Limits


@contextlib.contextmanager
def descriptors_raised(needed: int) -> Iterator[bool]:
    """This process's soft descriptor limit lifted to its hard one while inside (it opens the attack's
    connections itself), and put back after; yields False, changing nothing, when the hard limit is below
    `needed`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < needed:
        yield False
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield True
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def limit_descriptors(limit: int) -> Limits:
    """Limits (`hydrafl.benchmarks._reliability_cluster.set_limits`) that cap a process's descriptors at `limit`
    (soft and hard), as a default Linux login does."""
    return {resource.RLIMIT_NOFILE: (limit, limit)}


def descriptors(pid: int, limit: int) -> int:
    """Descriptors process `pid` holds (`limit` once it has exited)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError:
        return limit


def _tcp_rows() -> list[list[str]]:
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows += [line.split() for line in Path(table).read_text().splitlines()[1:]]
        except FileNotFoundError:
            pass
    return rows


def unaccepted(port: int) -> int:
    """Connections to `port` the kernel holds for the listener: its accept queue and half-open handshakes."""
    count = 0
    for fields in _tcp_rows():
        local_port, state = int(fields[1].rsplit(":", 1)[1], 16), fields[3]
        if local_port == port and state == "0A":  # listening: the accept queue's length
            count += int(fields[4].split(":")[1], 16)
        elif local_port == port and state == "03":  # SYN_RECV
            count += 1
    return count


def held_connections(pid: int, port: int) -> int:
    """Connections to `port` that process `pid` has accepted and still holds open (its socket descriptors whose
    /proc/net/tcp row is an established connection on that local port)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return sum(
        1
        for fields in _tcp_rows()
        if fields[3] in ("01", "08")
        and int(fields[1].rsplit(":", 1)[1], 16) == port
        and fields[9] in inodes
    )


def idlers(port: int, pid: int, count: int, limit: int) -> list[socket.socket]:
    """Up to `count` connections to `port` that never send a byte, each opened once the listener took the one
    before (a connection the kernel completed but the listener never accepted holds nothing of the
    coordinator's); stops when the coordinator is 8 descriptors from `limit` or three connects in a row fail."""
    conns: list[socket.socket] = []
    failures = 0
    while len(conns) < count and failures < 3 and descriptors(pid, limit) < limit - 8:
        conn = socket.socket()
        conn.settimeout(2)
        try:
            conn.connect(("127.0.0.1", port))
        except OSError:
            conn.close()
            failures += 1
            continue
        failures = 0
        conns.append(conn)
        accepted_by = time.monotonic() + 0.5
        while unaccepted(port) and time.monotonic() < accepted_by:
            time.sleep(0.002)
    return conns


def closed_by_peer(conns: list[socket.socket]) -> int:
    """How many of `conns` the other end has closed (or answered and closed): read without waiting."""
    closed = 0
    for conn in conns:
        try:
            conn.setblocking(False)
            data = conn.recv(4096)
            closed += 1 if not data or data.startswith(b"HTTP/1.0 408") else 0
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


class Trickle:
    """`count` slow clients: each sends an HTTP request one byte every `every_s` and never finishes it; the
    seconds until the server closed each one."""

    REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096

    def __init__(self, port: int, count: int, every_s: float = 0.2) -> None:
        self.conns = []
        for _ in range(count):
            try:
                self.conns.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                pass
        self.started = time.monotonic()
        self.closed_after: dict[int, float] = {}
        self.every_s = every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sent = 0
        while not self.stop.is_set() and len(self.closed_after) < len(self.conns):
            for i, conn in enumerate(self.conns):
                if i in self.closed_after:
                    continue
                try:
                    conn.sendall(
                        self.REQUEST[sent % len(self.REQUEST) : sent % len(self.REQUEST) + 1]
                    )
                    conn.setblocking(False)
                    data = conn.recv(4096)
                    if not data or data.startswith(b"HTTP/1.0 408"):
                        self.closed_after[i] = time.monotonic() - self.started
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed_after[i] = time.monotonic() - self.started
            sent += 1
            self.stop.wait(self.every_s)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for conn in self.conns:
            conn.close()


class HealthProbe:
    """The coordinator's gRPC health check every `every_s`, as an orchestrator's probe would, on a channel opened
    before any attack (a connection cap refuses new ones); each check's latency (inf: failed or timed out)
    and the phase it fell in."""

    def __init__(self, address: str, every_s: float = 1.0, timeout_s: float = 10.0) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.every_s, self.timeout_s = every_s, timeout_s
        self.phase = "before"
        self.latencies: dict[str, list[float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            phase, started = self.phase, time.perf_counter()
            try:
                reply = self.stub.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s
                )
                ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok = False
            self.latencies.setdefault(phase, []).append(
                time.perf_counter() - started if ok else float("inf")
            )
            self.stop.wait(max(0.0, self.every_s - (time.perf_counter() - started)))

    def summary(self, phase: str) -> dict[str, float | int]:
        """Checks in `phase`, failed ones, median and max latency in ms (inf when one failed)."""
        values = self.latencies.get(phase, [])
        return {
            "checks": len(values),
            "failed": sum(v == float("inf") for v in values),
            "median_ms": statistics.median(values) * 1e3 if values else float("nan"),
            "max_ms": max(values) * 1e3 if values else float("nan"),
        }

    def close(self) -> None:
        self.stop.set()
        self.thread.join(self.timeout_s + 2)
        self.channel.close()
