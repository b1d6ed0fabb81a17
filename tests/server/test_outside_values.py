"""Values from outside never reach a sink unbounded (issue 28, items 2 and 3): megabyte names and reasons from an
enrolled site, pushed to a real coordinator on loopback whose logs go through the handler `hydrafl server` sets up,
cost the log, the database, the gRPC status and the dashboard page a few hundred bytes each; the health check stays
fast during the attack; repeated refusals of one site in a round count on one audit row."""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console

import hydrafl.cli.common as cli_common
from hydrafl.bounded import MAX_DETAIL_CHARS, MAX_LOG_CHARS, MAX_NAME_CHARS, bounded
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import MAX_REASON_CHARS, split_message
from hydrafl.server import audit
from hydrafl.server.audit import record_refusal
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.dashboard_data import refused_per_run, site_rows
from hydrafl.server.dashboard_page import MAX_PAGE_CHARS, render_page
from hydrafl.server.store import Store
from hydrafl.server.tables import AuditEvent, Reply, Run, Site
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.limits import SiteLimits

SHAPE = (3, 2)
MARKER_CHARS = 40
"""Room for the cut marker ("...[cut, N more chars]") after a bounded text."""
LOG_BYTES_PER_REFUSAL = 4_096
DB_BYTES_PER_REFUSAL = 16_384


class Live:
    """A coordinator on loopback with sites a and b, one running run and a train message to each."""

    def __init__(self, tmp_path) -> None:
        self.db = tmp_path / "c.db"
        self.coordinator = Coordinator(
            CoordinatorConfig(
                listen="127.0.0.1:0",
                db_url=f"sqlite:///{self.db}",
                blob_dir=tmp_path / "blobs",
                runs_dir=tmp_path / "runs",
                limits=SiteLimits(stream_idle_s=1.0),
            )
        )
        self.coordinator.start()
        self.store = self.coordinator.store
        (site_a, self.token_a), _ = self.store.add_site("a"), self.store.add_site("b")
        self.node_a = site_a.node_id
        self.run_id = self.store.create_run({"rounds": 1}).id
        self.store.set_run_status(self.run_id, "running")
        self.grid = CoordinatorGrid(
            self.store, self.coordinator.blobs, self.coordinator.service, self.run_id
        )
        arrays = ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(SHAPE))})
        self.request = Message(
            RecordDict({"arrays": arrays}), dst_node_id=self.node_a, message_type="train"
        )
        self.request.metadata.group_id = "1"
        [self.request.metadata.__dict__["_message_id"]] = self.grid.push_messages([self.request])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.coordinator.port}")
        self.stub = CoordinatorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.coordinator.stop()

    def db_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.db.parent.glob(self.db.name + "*"))

    def reply(self, content: RecordDict) -> tuple[pb.Envelope, dict]:
        reply = Message(content, reply_to=self.request)
        reply.metadata.__dict__["_message_id"] = "r"
        return split_message(reply, 1)

    def push(self, envelope: pb.Envelope) -> tuple[grpc.StatusCode, str]:
        try:
            self.stub.PushReply(
                pb.PushReplyRequest(envelope=envelope), metadata=_auth(self.token_a), timeout=60
            )
        except grpc.RpcError as error:
            return error.code(), error.details()
        return grpc.StatusCode.OK, ""


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _delta(**metrics) -> RecordDict:
    values = np.full(SHAPE, 0.25, dtype=np.float32)
    return RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(values)}),
            "metrics": MetricRecord({"num-examples": 5, **metrics}),
        }
    )


@pytest.fixture
def server_log(tmp_path, monkeypatch):
    """The coordinator's logging as `hydrafl server` sets it up (`setup_logging`), into a file as a deployment's
    redirected stderr is; root logging is restored afterwards."""
    path = tmp_path / "coordinator.log"
    root, own, flower = logging.getLogger(), logging.getLogger("hydrafl"), logging.getLogger("flwr")
    saved = list(root.handlers), root.level, own.level, flower.level, flower.propagate
    with path.open("w") as stream:
        monkeypatch.setattr(cli_common, "console", Console(file=stream))
        cli_common.setup_logging(verbose=False)
        yield path
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    own.setLevel(saved[2])
    flower.setLevel(saved[3])
    flower.propagate = saved[4]


@pytest.fixture
def live(tmp_path):
    live = Live(tmp_path)
    yield live
    live.close()


def _log_bytes(path) -> int:
    return path.stat().st_size


def test_a_log_line_quoting_a_100k_word_takes_milliseconds(server_log):
    word = "w" * 100_000
    started = time.perf_counter()
    logging.getLogger("hydrafl.server.transport.service").warning(
        "refused INVALID_ARGUMENT from site a: array %s", word
    )
    elapsed_s = time.perf_counter() - started
    print(
        f"\nlogging a 100,000-character word took {elapsed_s * 1e3:.1f} ms, {_log_bytes(server_log)} bytes"
    )
    assert elapsed_s < 0.1, elapsed_s
    assert (
        _log_bytes(server_log) < 2 * MAX_LOG_CHARS
    )  # rich's time and level columns pad each wrapped line


def test_a_100k_character_tensor_name_is_refused_and_health_checks_stay_fast(live, server_log):
    latencies: list[float] = []
    stop = threading.Event()

    def check_health() -> None:  # every second, as an orchestrator's probe would
        while not stop.is_set():
            started = time.perf_counter()
            try:
                live.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                latencies.append(time.perf_counter() - started)
            except grpc.RpcError:
                latencies.append(float("inf"))
            stop.wait(max(0.0, 1.0 - (time.perf_counter() - started)))

    prober = threading.Thread(target=check_health)
    prober.start()
    try:
        time.sleep(1.5)
        results = []
        for _ in range(3):  # the attack lasts a few health checks
            envelope, _ = live.reply(_delta())
            envelope.arrays[0].tensors[0].name = "n" * 100_000
            started = time.perf_counter()
            results.append((*live.push(envelope), time.perf_counter() - started))
            time.sleep(0.5)
        time.sleep(1.0)
    finally:
        stop.set()
        prober.join()
    for code, details, seconds in results:
        assert (
            code == grpc.StatusCode.INVALID_ARGUMENT
            and "tensor name has 100000 characters" in details
        ), details
        assert len(details) <= MAX_DETAIL_CHARS + MARKER_CHARS and seconds < 1.0, (
            len(details),
            seconds,
        )
    print(
        f"\nhealth checks during the attack: max {max(latencies) * 1e3:.1f} ms over {len(latencies)}; refusals "
        f"took {', '.join(f'{seconds * 1e3:.0f} ms' for _, _, seconds in results)}"
    )
    assert len(latencies) >= 4 and max(latencies) < 0.5, latencies
    assert _log_bytes(server_log) < 3 * LOG_BYTES_PER_REFUSAL


def test_two_pushes_with_7mb_names_add_kilobytes_to_the_database_and_the_log(live, server_log):
    db_before, log_before = live.db_bytes(), _log_bytes(server_log)
    envelope, _ = live.reply(_delta())
    envelope.arrays[0].tensors[0].name = "n" * (7 << 20)
    assert live.push(envelope)[0] == grpc.StatusCode.INVALID_ARGUMENT
    envelope, _ = live.reply(_delta())
    envelope.arrays[0].key = "k" * (7 << 20)
    assert live.push(envelope)[0] == grpc.StatusCode.INVALID_ARGUMENT
    db_added, log_added = live.db_bytes() - db_before, _log_bytes(server_log) - log_before
    print(f"\ntwo 7 MB refusals added {db_added} bytes to the database and {log_added} to the log")
    assert db_added <= 2 * DB_BYTES_PER_REFUSAL and log_added <= 2 * LOG_BYTES_PER_REFUSAL


def _metric_name(envelope: pb.Envelope, live: Live, name: str) -> None:
    envelope.content = split_message(
        Message(
            RecordDict({"metrics": MetricRecord({"num-examples": 5, name: 1.0})}),
            reply_to=live.request,
        )
    )[0].content


@pytest.mark.parametrize(
    "case",
    [
        "tensor-name",
        "record-key",
        "dtype",
        "metric-name",
        "config-key",
        "error-reason",
        "chunk-digest",
        "has-chunks-digest",
    ],
)
def test_megabyte_names_and_reasons_are_bounded_on_every_sink(live, server_log, case):
    """Each refusal path: the status a site reads, the audit row, the stored reply and the log stay bounded."""
    huge = "x" * (1 << 20)
    envelope, _ = live.reply(_delta())
    if case == "tensor-name":
        envelope.arrays[0].tensors[0].name = huge
    elif case == "record-key":
        envelope.arrays[0].key = huge
    elif case == "dtype":
        envelope.arrays[0].tensors[0].dtype = huge
    elif case == "metric-name":
        _metric_name(envelope, live, huge)
    elif case == "config-key":
        envelope.content = split_message(
            Message(
                RecordDict(
                    {
                        "metrics": MetricRecord({"num-examples": 5}),
                        "config": ConfigRecord({huge: "v"}),
                    }
                ),
                reply_to=live.request,
            )
        )[0].content
    elif case == "error-reason":
        del envelope.arrays[:]
        envelope.content = b""
        envelope.error_code, envelope.error_reason = 1, huge
    log_before = _log_bytes(server_log)
    try:
        if case == "chunk-digest":
            live.stub.PutChunks(
                iter([pb.Chunk(digest=huge, data=b"\0" * 16)]), metadata=_auth(live.token_a)
            )
        elif case == "has-chunks-digest":
            live.stub.HasChunks(pb.HasChunksRequest(digests=[huge]), metadata=_auth(live.token_a))
        else:
            live.stub.PushReply(
                pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
            )
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    expected = grpc.StatusCode.OK if case == "error-reason" else grpc.StatusCode.INVALID_ARGUMENT
    assert code == expected, (code, details[:200])
    assert len(details) <= MAX_DETAIL_CHARS + MARKER_CHARS
    events = live.store.audit_events()
    assert all(len(event.detail) <= MAX_DETAIL_CHARS + MARKER_CHARS for event in events)
    assert case == "has-chunks-digest" or any(
        e.kind in ("update-rejected", "site-declined") for e in events
    )
    with live.store.session() as session:
        for reply in session.query(Reply):
            assert len(pb.Envelope.FromString(reply.envelope).error_reason) <= MAX_REASON_CHARS
    assert _log_bytes(server_log) - log_before <= LOG_BYTES_PER_REFUSAL


def test_names_longer_than_the_limit_are_refused_at_parse_time_and_shorter_ones_pass(live):
    envelope, _ = live.reply(_delta())
    envelope.arrays[0].tensors[0].name = "n" * (MAX_NAME_CHARS + 1)
    code, details = live.push(envelope)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_NAME_CHARS}" in details


def test_800_refusals_of_one_site_in_a_round_make_one_audit_row(live):
    envelope, _ = live.reply(_delta(loss=float("nan")))
    started = datetime.now(UTC)
    for _ in range(800):
        code, details = live.push(envelope)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a finite number" in details
    [row] = live.store.audit_events("update-rejected")
    assert (row.site_name, row.run_id, row.server_round, row.count) == ("a", live.run_id, 1, 800)
    first, last = (
        moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
        for moment in (row.at, row.last_at)
    )
    assert started.replace(microsecond=0) <= first.replace(microsecond=0) <= last
    assert row.detail.startswith("INVALID_ARGUMENT") and "not a finite number" in row.detail
    runs = live.store.runs()
    [site_a] = [
        site for site in site_rows(live.store, runs, live.coordinator.service) if site.name == "a"
    ]
    assert site_a.refused == 800  # the dashboard's and /metrics' counts are the rows' counts
    assert refused_per_run(live.store, runs)[str(live.run_id), "invalid_argument"] == 800


def test_the_dashboard_page_has_a_size_bound_whatever_the_tables_hold(tmp_path):
    """Rows written by an older coordinator (or straight into the database) with megabyte values: the page
    cuts every cell, and lists a bounded number of rows."""
    store = Store(f"sqlite:///{tmp_path / 'c.db'}")
    huge = "<" * (1 << 20)
    with store.session() as session, session.begin():
        session.add_all(
            Site(name=f"{i}{huge[:10_000]}", node_id=10_001 + i, token_hash=f"{i:064x}")
            for i in range(300)
        )
        session.add_all(
            Run(config={"strategy": huge[:10_000], "task": huge[:10_000]}, detail=huge[:10_000])
            for _ in range(300)
        )
        session.add(Run(config={"strategy": "fedavg", "task": huge}, status="running", detail=huge))
    for _ in range(150):
        with store.session() as session, session.begin():
            session.add(
                AuditEvent(kind="update-rejected", site_name=huge[:10_000], run_id=1, detail=huge)
            )
    page = render_page(store, tmp_path / "runs", None, None)
    print(f"\npage: {len(page)} characters")
    assert len(page) <= MAX_PAGE_CHARS
    assert "more chars]" in page and bounded("x" * 10) == "x" * 10


def test_a_refusal_of_another_round_or_after_a_pause_starts_a_new_row(tmp_path, monkeypatch):
    store = Store(f"sqlite:///{tmp_path / 'c.db'}")
    record_refusal(store, "a", "INVALID_ARGUMENT: one", 1, 1)
    record_refusal(store, "a", "INVALID_ARGUMENT: two", 1, 1)
    record_refusal(store, "a", "INVALID_ARGUMENT: three", 1, 2)
    record_refusal(store, "b", "INVALID_ARGUMENT: b's", 1, 2)  # another site's row in between
    record_refusal(store, "a", "INVALID_ARGUMENT: four", 1, 2)
    monkeypatch.setattr(audit, "REFUSAL_ROW_S", 0.0)  # the row's last refusal is now too old
    record_refusal(store, "a", "INVALID_ARGUMENT: five", 1, 2)
    rows = [
        (e.site_name, e.server_round, e.count, e.detail)
        for e in store.audit_events("update-rejected")
    ]
    assert rows == [
        ("a", 1, 2, "INVALID_ARGUMENT: one"),
        ("a", 2, 2, "INVALID_ARGUMENT: three"),
        ("b", 2, 1, "INVALID_ARGUMENT: b's"),
        ("a", 2, 1, "INVALID_ARGUMENT: five"),
    ]
