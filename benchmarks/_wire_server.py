"""A gRPC server in its own process for the wire benchmarks, and the parent's handle on it.

    python -m hydrafl.benchmarks._wire_server coordinator --db URL --blobs DIR --runs DIR [--serve]
    python -m hydrafl.benchmarks._wire_server raw

The child prints one JSON line ({"port": N}) once it serves, and stops when its stdin closes, so a parent that
dies takes it down too. A separate process is what a real deployment has (site and coordinator never share a
GIL) and lets the parent sample the server's RSS alone.

`coordinator` is hydrafl's `Coordinator` (gRPC service + health; with `--serve` it also drives queued runs, as
`hydrafl server` does); each JSON line the parent writes asks it to store a model message (`ServerProcess.ask`).
`raw` is the floor to compare it with: a generic stream-unary handler that only counts the bytes it receives,
and a unary-stream handler that sends N 1 MiB messages, served with the coordinator's thread-pool size and gRPC
options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

RAW_METHOD = "/hydrafl.bench.RawSink/Put"
RAW_GET_METHOD = "/hydrafl.bench.RawSink/Get"
"""Request: the number of bytes (8 bytes, little-endian); reply: that many bytes in CHUNK_BYTES messages."""
SERVER_WORKERS = 16  # Coordinator's ThreadPoolExecutor size
SAMPLE_S = 0.05
ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def _raw_put(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return sum(len(request) for request in requests).to_bytes(8, "little")


def _raw_get(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    from hydrafl.proto.envelope import CHUNK_BYTES

    remaining = int.from_bytes(request, "little")
    block = os.urandom(CHUNK_BYTES)
    while remaining > 0:
        yield block[: min(remaining, CHUNK_BYTES)]
        remaining -= CHUNK_BYTES


def _serve_raw() -> grpc.Server:
    from hydrafl.server.transport.service import SERVER_OPTIONS

    service, put = RAW_METHOD.strip("/").split("/")
    get = RAW_GET_METHOD.rsplit("/", 1)[1]
    handler = grpc.method_handlers_generic_handler(
        service,
        {
            put: grpc.stream_unary_rpc_method_handler(_raw_put),
            get: grpc.unary_stream_rpc_method_handler(_raw_get),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=SERVER_WORKERS), options=SERVER_OPTIONS
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)
    return server


def _push_model(
    coordinator: Any, models: dict[tuple[int, int], list], request: dict[str, Any]
) -> dict[str, Any]:
    """The coordinator stores a model message for one site, as a round does: in its own process, whose blob store
    (and its cache of what it sends) then serves the download. `models` keeps each (bytes, seed)'s arrays."""
    from hydrafl.benchmarks._wire_download import model_message
    from hydrafl.benchmarks._wire_pairs import mark
    from hydrafl.benchmarks._wire_setup import make_update
    from hydrafl.server.transport.grid import CoordinatorGrid

    key = (request["nbytes"], request["seed"])
    if key not in models:  # generated once: 1 GiB of random values takes seconds
        models[key] = make_update(*key)
    arrays = models[key]
    mark(arrays, request["mark"])
    grid = CoordinatorGrid(
        coordinator.store, coordinator.blobs, coordinator.service, request["run_id"]
    )
    message = model_message(
        arrays, request["node_id"], request["round"]
    )  # after the grid claims the run
    started = time.perf_counter()
    [message_id] = grid.push_messages([message])
    return {"message_id": message_id, "store_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("coordinator", "raw"))
    parser.add_argument("--db", default="")
    parser.add_argument("--blobs", type=Path)
    parser.add_argument("--runs", type=Path)
    parser.add_argument(
        "--serve", action="store_true", help="also drive queued runs (serve_forever)"
    )
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.kind == "raw":
        server = _serve_raw()
        sys.stdin.read()
        server.stop(grace=1).wait()
        return
    from hydrafl.benchmarks._wire_floor import floor_here
    from hydrafl.malloc_tuning import keep_freed_memory
    from hydrafl.server.config import CoordinatorConfig
    from hydrafl.server.coordinator import Coordinator

    keep_freed_memory()  # as `hydrafl server` does
    config = CoordinatorConfig(
        listen="127.0.0.1:0", db_url=args.db, blob_dir=args.blobs, runs_dir=args.runs
    )
    coordinator = Coordinator(config)
    coordinator.start()
    if args.serve:
        threading.Thread(
            target=coordinator.serve_forever, name="serve_forever", daemon=True
        ).start()
    print(json.dumps({"port": coordinator.port}), flush=True)
    models: dict[tuple[int, int], list] = {}
    for line in sys.stdin:  # until the parent closes it
        request = json.loads(line)
        answer = (
            floor_here(models, request)
            if "floor" in request
            else _push_model(coordinator, models, request)
        )
        print(json.dumps(answer), flush=True)
    coordinator.stop()
    logging.shutdown()
    os._exit(0)  # skip the interpreter's teardown of torch & co. (~2 s); nothing is left to flush


# ---- parent side -----------------------------------------------------------------------------------


@dataclass
class RssSampler:
    """RSS of one process every SAMPLE_S seconds, in a background thread (peaks shorter than that can be
    missed, so the kernel's high-water mark VmHWM is read as well)."""

    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> RssSampler:
        process = psutil.Process(self.pid)

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.samples.append((time.monotonic(), process.memory_info().rss))
                except psutil.NoSuchProcess:
                    return
                self._stop.wait(SAMPLE_S)

        self._thread = threading.Thread(target=loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def now(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def peak(self, since: float = 0.0) -> int:
        return max((rss for at, rss in self.samples if at >= since), default=0)

    def high_water_mark(self) -> int:
        """VmHWM: the process's peak RSS over its whole life, exact (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc status")


class ServerProcess:
    """A server child: spawned at construction, so several can import in parallel; `wait_ready` for its port;
    stopped (stdin closed, killed if it lingers) on exit."""

    def __init__(self, kind: str, *args: str, log_path: Path) -> None:
        self.kind = kind
        self.log_path = log_path
        self.port = 0
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hydrafl.benchmarks._wire_server", kind, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, **ENV},
            )
        assert self.process.stdin is not None and self.process.stdout is not None  # both piped
        self.requests, self.replies = self.process.stdin, self.process.stdout

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self) -> ServerProcess:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"{self.kind} server did not start:\n{self.log_tail()}")
        self.port = int(json.loads(line)["port"])
        return self

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request to a coordinator child (`_push_model`), and its answer."""
        self.requests.write(json.dumps(request) + "\n")
        self.requests.flush()
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"{self.kind} server stopped:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Close its stdin (it stops and exits); kill it if it lingers. Idempotent."""
        if self.requests.closed:
            return
        self.requests.close()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def filesystem(path: Path) -> str:
    """The filesystem holding the blobs (fsync costs depend on it)."""
    mounts = [
        part
        for part in psutil.disk_partitions(all=True)
        if str(path.resolve()).startswith(part.mountpoint)
    ]
    best = max(mounts, key=lambda part: len(part.mountpoint))
    return f"{best.fstype} on {best.device} ({best.mountpoint})"


if __name__ == "__main__":
    main()
