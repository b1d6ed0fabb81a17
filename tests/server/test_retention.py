"""Storage stays bounded: a checkpointed round's messages, replies and chunks go (round 0 and what open rows refer to
stay), ended runs keep their history and final model, sweeps are idempotent, and operators can gc and delete runs."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from helpers import local_coordinator
from sqlalchemy import func, select
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import chunk_hashes, split_message
from hydrafl.server.aggregation.checkpoint import CHECKPOINT_FILE, Checkpoint, save_checkpoint
from hydrafl.server.blobs import BlobStore
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.retention import Retention, was_swept
from hydrafl.server.store import Store
from hydrafl.server.tables import AuditEvent, OutboundMessage, Reply
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.service import CoordinatorService
from hydrafl.validation import ConfigError


class Home:
    """A coordinator's database, blob store and run folders, with one running run over three sites."""

    def __init__(self, db_url: str, root: Path) -> None:
        self.db_url, self.root = db_url, root
        self.store = Store(db_url)
        self.nodes = [self.store.add_site(f"site-{i}")[0].node_id for i in range(3)]
        self.run_id = self.store.create_run({"rounds": 5}).id
        self.store.set_run_status(self.run_id, "running")
        self.blobs = BlobStore(root / "blobs")
        self.runs = root / "runs"
        self.grid = CoordinatorGrid(
            self.store,
            self.blobs,
            CoordinatorService(self.store, self.blobs),
            self.run_id,
            poll_interval_s=0.01,
        )
        self.retention = Retention(self.store, self.blobs, self.runs, keep_checkpoints=2)

    def round(
        self, server_round: int, model_value: float, *, answered: tuple[int, ...] | None = None
    ) -> None:
        """Push a round's train messages (the model filled with `model_value`) and store the replies of `answered`."""
        arrays = ArrayRecord({"w": Array(np.full(64, model_value, dtype=np.float32))})
        messages = [
            Message(RecordDict({"arrays": arrays}), dst_node_id=node, message_type="train")
            for node in self.nodes
        ]
        for message in messages:
            message.metadata.group_id = str(server_round)
        self.grid.push_messages(messages)
        for message in messages:
            if message.metadata.dst_node_id in (self.nodes if answered is None else answered):
                self.reply(message, model_value + message.metadata.dst_node_id)

    def reply(self, message: Message, value: float) -> None:
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.full(64, value, dtype=np.float32))}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        reply = Message(content, reply_to=message)
        reply.metadata.__dict__["_message_id"] = f"{message.metadata.message_id}.reply"
        envelope, chunks = split_message(reply, 1)
        self.blobs.uploads(message.metadata.dst_node_id).put_stream(chunks.items())
        self.store.add_reply(
            self.store.outbound(message.metadata.message_id), envelope.SerializeToString()
        )

    def checkpoint(self, server_round: int) -> None:
        """What the driver does before its round callback: commit the round's checkpoint."""
        save_checkpoint(
            self.runs / str(self.run_id),
            Checkpoint(
                server_round=server_round,
                arrays=ArrayRecord({"w": Array(np.full(100, server_round, dtype=np.float32))}),
                strategy_state={},
                history=[{"round": server_round}],
                run_config={},
            ),
        )

    def rounds_stored(self) -> list[int]:
        with self.store.session() as session:
            return sorted({row.server_round for row in session.scalars(select(OutboundMessage))})

    def chunk_files(self) -> set[str]:
        root = self.root / "blobs"
        return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()}

    def rows(self) -> int:
        with self.store.session() as session:
            return sum(
                session.scalar(select(func.count()).select_from(table))
                for table in (OutboundMessage, Reply)
            )

    def assert_nothing_referenced_is_missing(self) -> None:
        with self.store.session() as session:
            for message in session.scalars(select(OutboundMessage)):
                assert not self.blobs.missing(
                    chunk_hashes(pb.Envelope.FromString(message.envelope))
                )
            for reply in session.scalars(select(Reply)):
                uploads = self.blobs.uploads(reply.node_id)
                assert not uploads.missing(chunk_hashes(pb.Envelope.FromString(reply.envelope)))


@pytest.fixture
def home(db_url, tmp_path) -> Home:
    return Home(db_url, tmp_path)


def test_a_checkpointed_round_goes_with_its_chunks_and_round_0_stays(home):
    for server_round, value in [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 1.0),
    ]:  # round 3 re-sends round 1's model
        home.round(server_round, value)
    home.blobs.put(*_chunk(home.blobs, b"orphan"))
    home.retention.after_checkpoint(home.run_id, 2)
    assert home.rounds_stored() == [0, 3]
    home.assert_nothing_referenced_is_missing()
    assert (
        len(home.blobs.digests()) == 2
    )  # round 0's model and round 1's, which round 3 shares; no orphan
    for node in home.nodes:
        assert len(home.blobs.uploads(node).digests()) == 2  # its replies of rounds 0 and 3
    before = home.chunk_files(), home.rows()
    again = home.retention.after_checkpoint(home.run_id, 2)
    assert (again.messages, again.chunks) == (0, 0) and (home.chunk_files(), home.rows()) == before


def test_uploads_of_a_site_that_may_still_answer_are_kept(home):
    home.round(1, 1.0, answered=tuple(home.nodes[1:]))  # the first site has not answered yet
    for node in home.nodes[:2]:
        home.blobs.uploads(node).put(
            *_chunk(home.blobs.uploads(node), b"an upload no reply refers to yet")
        )
    home.retention.after_checkpoint(home.run_id, 0)
    assert len(home.blobs.uploads(home.nodes[0]).digests()) == 1  # in flight: kept
    assert (
        len(home.blobs.uploads(home.nodes[1]).digests()) == 1
    )  # its reply's chunk only: the stray upload went
    home.assert_nothing_referenced_is_missing()


def test_an_ended_run_keeps_its_history_audit_events_and_last_checkpoints(home):
    for server_round in range(5):
        home.round(server_round, float(server_round))
        home.checkpoint(server_round)
        home.store.set_run_status(
            home.run_id, "running", rounds_done=server_round, history=[{"round": server_round}]
        )
        home.retention.after_checkpoint(home.run_id, server_round)
    home.store.set_run_status(home.run_id, "finished")
    home.retention.after_run(home.run_id)
    assert home.rows() == 0 and home.chunk_files() == set()
    run = home.store.run(home.run_id)
    assert run.history == [{"round": 4}] and home.store.run_events(
        home.run_id, ["update-accepted", "run-finished"]
    )
    folder = home.runs / str(home.run_id)
    kept = sorted(path.name for path in (folder / "checkpoints").iterdir())
    assert [name[:11] for name in kept] == ["round-00003"] * 2 + ["round-00004"] * 2
    assert (folder / "checkpoints" / "round-00004.json").samefile(folder / CHECKPOINT_FILE) and (
        folder / "checkpoints" / kept[-2]
    ).samefile(next(folder.glob("round-*.safetensors")))  # the final model, one copy


def test_gc_dry_run_changes_nothing_and_gc_deletes_what_it_said(home):
    home.round(0, 0.0)
    home.round(1, 1.0)
    home.checkpoint(1)
    for server_round in range(4):
        (home.runs / str(home.run_id) / "checkpoints").mkdir(parents=True, exist_ok=True)
        (
            home.runs / str(home.run_id) / "checkpoints" / f"round-{server_round:05d}.pkl"
        ).write_bytes(b"x" * 1000)
    home.store.set_run_status(home.run_id, "failed", detail="a test")
    home.blobs.put(*_chunk(home.blobs, b"orphan"))
    args = [
        "admin",
        "gc",
        "--db",
        home.db_url,
        "--blobs",
        str(home.root / "blobs"),
        "--runs",
        str(home.runs),
    ]
    before = home.chunk_files(), home.rows(), sorted(home.runs.rglob("*"))
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert (
        "would delete: 6 messages, 6 replies, 9 chunks" in dry.output
        and "2 run-folder files" in dry.output
    )
    assert (home.chunk_files(), home.rows(), sorted(home.runs.rglob("*"))) == before
    real = CliRunner().invoke(app, args)
    assert real.exit_code == 0, real.output
    assert real.output.replace("deleted: ", "would delete: ") == dry.output
    assert home.chunk_files() == set() and home.rows() == 0
    assert (
        CliRunner().invoke(app, args).output.startswith("deleted: 0 messages, 0 replies, 0 chunks")
    )


def test_run_delete_refuses_a_running_run_and_removes_an_ended_one(home):
    home.round(0, 0.0)
    home.checkpoint(0)
    args = [
        "admin",
        "run",
        "delete",
        str(home.run_id),
        "--db",
        home.db_url,
        "--blobs",
        str(home.root / "blobs"),
        "--runs",
        str(home.runs),
    ]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 1 and "is running" in refused.output
    assert home.rows() == 6 and (home.runs / str(home.run_id) / CHECKPOINT_FILE).exists()
    home.store.set_run_status(home.run_id, "finished")
    deleted = CliRunner().invoke(app, args)
    assert deleted.exit_code == 0, deleted.output
    assert (
        home.rows() == 0
        and home.chunk_files() == set()
        and not (home.runs / str(home.run_id)).exists()
    )
    assert [run.id for run in home.store.runs()] == []
    with home.store.session() as session:
        assert not list(session.scalars(select(AuditEvent).where(AuditEvent.run_id == home.run_id)))
    assert home.store.audit_events("run-deleted")
    assert CliRunner().invoke(app, args).exit_code == 2  # no such run any more


def test_a_late_reply_to_a_swept_round_is_refused_as_late_not_as_another_sites(home):
    home.round(1, 1.0)
    home.store.set_run_status(home.run_id, "running", rounds_done=1)
    home.retention.after_checkpoint(home.run_id, 1)
    node = home.nodes[0]
    assert was_swept(home.store, f"{home.run_id}-1-train-{node}-0", node)
    assert not was_swept(home.store, f"{home.run_id}-1-train-{node}-0", home.nodes[1])
    assert not was_swept(home.store, f"{home.run_id}-2-train-{node}-0", node)  # not done yet
    assert not was_swept(home.store, "garbage", node)
    assert was_swept(home.store, f"{home.run_id + 1}-1-train-{node}-0", node)  # a deleted run's


def _chunk(blobs: BlobStore, data: bytes) -> tuple[str, bytes]:
    return blobs.naming.digest(data), data


def test_keep_checkpoints_is_a_coordinator_key_of_at_least_one():
    assert CoordinatorConfig.from_options({"keep-checkpoints": 5}).keep_checkpoints == 5
    assert CoordinatorConfig().keep_checkpoints == 2
    for bad in (0, "2", 1.5, True):
        with pytest.raises(
            ConfigError, match="keep-checkpoints must be a whole number of at least 1"
        ):
            CoordinatorConfig.from_options({"keep-checkpoints": bad})


def test_a_straggler_pushing_to_a_swept_round_is_told_late_not_refused(tmp_path):
    """FAILED_PRECONDITION makes a site drop the reply and go on; PERMISSION_DENIED would stop it."""
    coordinator = local_coordinator(tmp_path)
    try:
        store = coordinator.store
        (site_a, token_a), (_, token_b) = store.add_site("a"), store.add_site("b")
        run = store.create_run({"rounds": 2})
        store.set_run_status(run.id, "running")
        grid = CoordinatorGrid(store, coordinator.blobs, coordinator.service, run.id)
        request = Message(
            RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(4, dtype=np.float32))})}),
            dst_node_id=site_a.node_id,
            message_type="train",
        )
        request.metadata.group_id = "1"
        [message_id] = grid.push_messages([request])
        store.set_run_status(run.id, "running", rounds_done=1)
        coordinator.retention.after_checkpoint(run.id, 1)
        assert store.outbound(message_id) is None
        late = pb.PushReplyRequest(
            envelope=pb.Envelope(reply_to_message_id=message_id, error_code=1)
        )
        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = CoordinatorStub(channel)
            codes = (
                (token_a, grpc.StatusCode.FAILED_PRECONDITION),
                (token_b, grpc.StatusCode.PERMISSION_DENIED),
            )
            for token, code in codes:
                with pytest.raises(grpc.RpcError) as raised:
                    stub.PushReply(late, metadata=(("authorization", f"Bearer {token}"),))
                assert raised.value.code() == code
    finally:
        coordinator.stop()
