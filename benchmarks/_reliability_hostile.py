"""Hostile requests against a running coordinator, each kind with the status the README's security section
gives it, sent while a real run goes on.

The attacker holds an enrolled site's token ("mallory") and takes part in the run: its own agent runs in this
process and answers its messages honestly, so the attacker has messages of its own to forge replies to, as a
compromised hospital would. Its hostile calls never overlap its agent's uploads (`SerialisedAgent`), because a
refused upload deletes the site's own pending chunks by design (a site may only hurt itself), and they forge
replies only to messages it has already answered (a valid forged reply to an open message would simply be its
reply). Calls that fail authentication come from another address ([::1]): an address with 10 failures in 60 s
is refused with RESOURCE_EXHAUSTED for the rest of the window, which would otherwise stall the honest sites.

Slow clients and long strings (issue 28): connections that never send a byte or send one byte at a time, to the
dashboard's and the sites' ports of a coordinator held at 1,024 descriptors (`idlers`, `Trickle`, counted from
/proc by `held_connections`), and pushes whose tensor names are 100,000 characters or 7 MB long
(`push_long_name`), while `HealthProbe` checks the coordinator's health every second.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
from flwr.app import Array, ArrayRecord, Message, Metadata, RecordDict
from flwr.app.message.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID
from sqlalchemy import select

from hydrafl.apps import client_app
from hydrafl.client.agent import SiteAgent
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import CHUNK_BYTES, SENT, UPLOADED, split_message
from hydrafl.protocol import GRPC_OPTIONS, MAX_GRPC_MESSAGE_BYTES
from hydrafl.server.store import Store
from hydrafl.server.tables import OutboundMessage, Reply

SERVICE = "/hydrafl.proto.Coordinator/"
OK, UNAUTH, DENIED = (
    grpc.StatusCode.OK,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)
PRECONDITION, INVALID = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
AUTH_KINDS = ("no token", "not Bearer", "wrong token", "revoked token")
KINDS: dict[str, tuple[frozenset[grpc.StatusCode], float]] = {
    **{kind: (frozenset({UNAUTH, EXHAUSTED}), 1.0) for kind in AUTH_KINDS},
    "random bytes": (frozenset({INVALID}), 1.0),
    "truncated protobuf": (frozenset({INVALID}), 1.0),
    "oversize chunk (1 MiB + 1)": (frozenset({INVALID, PRECONDITION}), 0.5),
    "oversize message (8 MiB + 1)": (frozenset({EXHAUSTED}), 0.05),
    "chunk failing its hash": (frozenset({INVALID, PRECONDITION}), 1.0),
    "wrong shape": (frozenset({INVALID}), 1.0),
    "wrong dtype": (frozenset({INVALID}), 1.0),
    "NaN": (frozenset({INVALID}), 1.0),
    "Inf": (frozenset({INVALID}), 1.0),
    "replay of an earlier run's reply": (frozenset({PRECONDITION}), 1.0),
    "replay of an answered message": (frozenset({OK}), 1.0),
    "another site's message id": (frozenset({DENIED}), 1.0),
    "another site's chunk": (frozenset({DENIED}), 1.0),
}
"""Each kind -> (the statuses that are right for it, its share of the requests). UNAUTHENTICATED turns into
RESOURCE_EXHAUSTED once the address is throttled; an upload is FAILED_PRECONDITION while the site has no
message to answer, else checked (INVALID_ARGUMENT); an exact replay of an accepted reply is acknowledged as a
duplicate (OK, duplicate=true, nothing stored): that is what lets a site retry a push whose answer it lost."""
FORGED = frozenset(
    {
        "truncated protobuf",
        "wrong shape",
        "wrong dtype",
        "NaN",
        "Inf",
        "replay of an answered message",
        "another site's message id",
        "oversize message (8 MiB + 1)",
    }
)
"""Kinds built on a reply mallory pushed. Its message is deleted once its round is checkpointed (retention), and
a reply to it is then late: FAILED_PRECONDITION "late reply refused" is right for these kinds too."""
LATE = "late reply refused"
SENT_TO_IT = "sent to it too"
"""A chunk another site uploaded may hold the same bytes as a chunk of a message to mallory (a tensor the round
left unchanged): mallory may download those bytes, which it was sent anyway."""


class SerialisedAgent(SiteAgent):
    """A site agent whose uploads hold `lock`, so the attacker's calls under the same token never interleave."""

    lock = threading.Lock()

    def _push(self, stub: CoordinatorClient, reply: Message, server_round: int) -> None:
        with self.lock:
            super()._push(stub, reply, server_round)


def start_agent(address: str, token: str) -> tuple[threading.Thread, threading.Event]:
    """The attacker's own honest agent, in a thread of this process."""
    stop = threading.Event()
    agent = SerialisedAgent(address, token, client_app, {}, demo=True)
    thread = threading.Thread(
        target=agent.run, kwargs={"stop": stop, "max_backoff_s": 2.0}, daemon=True
    )
    thread.start()
    return thread, stop


def add_earlier_run(store: Store, config: dict, node_id: int) -> str:
    """A finished run with a train message to `node_id`, before the coordinator starts: what a replay of an
    old message answers. Its message id."""
    run = store.create_run(config)
    message_id = f"{run.id}-1-train-{node_id}-0"
    metadata = Metadata(
        run_id=run.id,
        message_id=message_id,
        src_node_id=SUPERLINK_NODE_ID,
        dst_node_id=node_id,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=3600.0,
        message_type="train",
    )
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros((3, 2), np.float32))})})
    envelope, _ = split_message(make_message(metadata=metadata, content=content), 1)
    store.add_outbound(message_id, run.id, 1, node_id, envelope.SerializeToString())
    store.set_run_status(run.id, "finished")
    return message_id


@dataclass
class Tally:
    """Per kind: requests sent and the statuses they got; crashes seen by the health checks."""

    sent: Counter[str] = field(default_factory=Counter)
    got: dict[str, Counter[str]] = field(default_factory=dict)
    wrong: dict[str, Counter[str]] = field(default_factory=dict)
    health_checks: int = 0
    crashes: int = 0

    def record(self, kind: str, code: grpc.StatusCode, details: str) -> None:
        late = code == PRECONDITION and LATE in details and kind in FORGED
        own = code == OK and details == SENT_TO_IT and kind == "another site's chunk"
        self.sent[kind] += 1
        label = (
            f"{code.name} (late)"
            if late
            else f"OK ({details})"
            if code == OK and details
            else code.name
        )
        self.got.setdefault(kind, Counter())[label] += 1
        if (code not in KINDS[kind][0] and not late and not own) or (
            code == OK and details and not own
        ):
            self.wrong.setdefault(kind, Counter())[f"{code.name}: {details[:80]}"] += 1


class Attacker:
    """Crafts and sends each kind of hostile request with mallory's token (or none, or a wrong one)."""

    def __init__(
        self,
        address: str,
        v6_address: str,
        store: Store,
        run_id: int,
        tokens: dict[str, str],
        earlier_message: str,
        seed: int,
    ) -> None:
        self.rng = random.Random(seed)
        self.store, self.run_id, self.earlier_message = store, run_id, earlier_message
        self.token, self.revoked = tokens["mallory"], tokens["revoked"]
        self.node = next(site.node_id for site in store.sites() if site.name == "mallory")
        options = [*GRPC_OPTIONS, ("grpc.max_send_message_length", 2 * MAX_GRPC_MESSAGE_BYTES)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.v6_channel = grpc.insecure_channel(v6_address, options=options)
        self.stub = CoordinatorStub(self.channel)
        self.template: pb.Envelope | None = None
        self.others_seen: set[str] = set()

    def close(self) -> None:
        self.channel.close()
        self.v6_channel.close()

    def ready(self) -> bool:
        """Mallory has answered a train message of the run and another site's message has been seen: forged
        replies have something to answer and someone else's message to claim. The newest such reply still stored
        becomes the template (the last one seen stays when its round is gone)."""
        with self.store.session() as session:
            rows = session.scalars(
                select(Reply)
                .where(Reply.run_id == self.run_id, Reply.node_id == self.node)
                .order_by(Reply.id.desc())
            )
            for row in rows:
                envelope = pb.Envelope.FromString(row.envelope)
                if envelope.message_type == "train" and envelope.arrays:
                    self.template = envelope
                    break
        self.others_seen.update(message.message_id for message in self._other_messages())
        return self.template is not None and bool(self.others_seen)

    def send(self, kind: str) -> tuple[grpc.StatusCode, str]:
        """One request of `kind`, under the agent's lock; its status and details (for an accepted request,
        what the kind's method says about it)."""
        with SerialisedAgent.lock:
            if kind in FORGED:
                self.ready()
            try:
                said = getattr(self, "_" + kind.split(" (")[0].replace(" ", "_").replace("'", ""))()
            except grpc.RpcError as error:
                return error.code(), error.details() or ""
        return OK, said or ""

    def _auth(self, token: str | None = None) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token or self.token}"),)

    def _call_v6(self, metadata: tuple[tuple[str, str], ...]) -> None:
        method = self.rng.choice(["Join", "PullMessage", "HasChunks", "PushReply"])
        call = self.v6_channel.unary_unary(SERVICE + method, lambda data: data, lambda data: data)
        call(b"", metadata=metadata, timeout=10)

    def _no_token(self) -> None:
        self._call_v6(())

    def _not_Bearer(self) -> None:
        self._call_v6(
            (("authorization", self.rng.choice([self.token, f"Basic {self.token}", "Bearer "])),)
        )

    def _wrong_token(self) -> None:
        self._call_v6(self._auth(f"{self.rng.getrandbits(128):032x}"))

    def _revoked_token(self) -> None:
        self._call_v6(self._auth(self.revoked))

    def _raw(self, method: str, data: bytes) -> None:
        call = self.channel.unary_unary(SERVICE + method, lambda raw: raw, lambda raw: raw)
        call(data, metadata=self._auth(), timeout=10)

    def _random_bytes(self) -> None:
        junk = bytes(self.rng.getrandbits(8) for _ in range(self.rng.randrange(1, 200)))
        self._raw(
            self.rng.choice(["Join", "PullMessage", "HasChunks", "PushReply"]), b"\x0f" + junk
        )  # wire type 7

    def _truncated_protobuf(self) -> None:
        whole = pb.PushReplyRequest(envelope=self._forged()).SerializeToString()
        self._raw(
            "PushReply", whole[: self.rng.randrange(3, len(whole))]
        )  # inside the envelope's declared length

    def _upload(self, chunks: dict[str, bytes]) -> None:
        self.stub.PutChunks(
            iter(pb.Chunk(digest=d, data=c) for d, c in chunks.items()),
            metadata=self._auth(),
            timeout=30,
        )

    def _oversize_chunk(self) -> None:
        data = self.rng.randbytes(CHUNK_BYTES + 1)
        self._upload({UPLOADED.digest(data): data})

    def _oversize_message(self) -> None:
        envelope = self._forged()
        envelope.content = self.rng.randbytes(MAX_GRPC_MESSAGE_BYTES + 1)
        self._push(envelope)

    def _chunk_failing_its_hash(self) -> None:
        data = self.rng.randbytes(self.rng.randrange(1, 4096))
        self._upload({UPLOADED.digest(data + b"!"): data})

    def _forged(self) -> pb.Envelope:
        assert self.template is not None
        forged = pb.Envelope()
        forged.CopyFrom(self.template)
        return forged

    def _push(self, envelope: pb.Envelope) -> None:
        self.stub.PushReply(
            pb.PushReplyRequest(envelope=envelope), metadata=self._auth(), timeout=30
        )

    def _wrong_shape(self) -> None:
        forged = self._forged()
        tensor = forged.arrays[0].tensors[self.rng.randrange(len(forged.arrays[0].tensors))]
        tensor.shape[:] = self.rng.choice(
            [[*tensor.shape, 1], [x + 1 for x in tensor.shape], [2**40], []]
        )
        self._push(forged)

    def _wrong_dtype(self) -> None:
        forged = self._forged()
        forged.arrays[0].tensors[0].dtype = self.rng.choice(
            ["float64", "int8", "object", "<U8", "bool", ""]
        )
        self._push(forged)

    def _non_finite(self, value: float) -> None:
        forged = self._forged()
        tensor = forged.arrays[0].tensors[self.rng.randrange(len(forged.arrays[0].tensors))]
        values = np.zeros(tensor.nbytes // 4, np.float32)
        values[self.rng.randrange(values.size)] = value
        data = values.tobytes()
        chunks = {
            UPLOADED.digest(data[i : i + CHUNK_BYTES]): data[i : i + CHUNK_BYTES]
            for i in range(0, len(data), CHUNK_BYTES)
        }
        tensor.chunk_digests[:] = list(chunks)
        try:
            self._upload(chunks)
        except grpc.RpcError:  # nothing to answer right now: the push must still be refused
            pass
        self._push(forged)

    def _NaN(self) -> None:
        self._non_finite(float("nan"))

    def _Inf(self) -> None:
        self._non_finite(self.rng.choice([float("inf"), float("-inf")]))

    def _replay_of_an_earlier_runs_reply(self) -> None:
        forged = self._forged()
        forged.reply_to_message_id = self.earlier_message
        self._push(forged)

    def _replay_of_an_answered_message(self) -> str:
        reply = self.stub.PushReply(
            pb.PushReplyRequest(envelope=self._forged()), metadata=self._auth(), timeout=30
        )
        return "" if reply.duplicate else "stored as a new reply"

    def _other_messages(self) -> list[OutboundMessage]:
        with self.store.session() as session:
            return list(
                session.scalars(
                    select(OutboundMessage).where(
                        OutboundMessage.run_id == self.run_id, OutboundMessage.node_id != self.node
                    )
                )
            )

    def _another_sites_message_id(self) -> None:
        forged = self._forged()
        # between rounds the other sites may have no message stored: one seen earlier is still theirs
        self.others_seen.update(message.message_id for message in self._other_messages())
        forged.reply_to_message_id = self.rng.choice(sorted(self.others_seen))
        self._push(forged)

    def _another_sites_chunk(self) -> str:
        digest = self.rng.choice([SENT.digest(self.rng.randbytes(16)), *self._foreign_uploads()])
        list(
            self.stub.GetChunks(
                pb.GetChunksRequest(digests=[digest]), metadata=self._auth(), timeout=30
            )
        )
        return (
            SENT_TO_IT
            if digest in self._chunks_sent_to_mallory()
            else "downloaded another site's chunk"
        )

    def _chunks_sent_to_mallory(self) -> set[str]:
        with self.store.session() as session:
            rows = session.scalars(
                select(OutboundMessage.envelope).where(OutboundMessage.node_id == self.node)
            )
            return {
                d
                for envelope in rows
                for a in pb.Envelope.FromString(envelope).arrays
                for t in a.tensors
                for d in t.chunk_digests
            }

    def _foreign_uploads(self) -> list[str]:
        """Chunks the honest sites uploaded with their replies (none of them sent to mallory)."""
        foreign: set[str] = set()
        with self.store.session() as session:
            for row in session.scalars(
                select(Reply).where(Reply.run_id == self.run_id, Reply.node_id != self.node)
            ):
                foreign.update(
                    d
                    for a in pb.Envelope.FromString(row.envelope).arrays
                    for t in a.tensors
                    for d in t.chunk_digests
                )
        return sorted(foreign)[:20]


def attack(
    attacker: Attacker,
    requests: int,
    healthy: Callable[[], bool],
    running: Callable[[], bool],
    progress: Callable[[int], None],
) -> Tally:
    """`requests` hostile requests, kinds drawn by their shares, while the run is running; the coordinator's
    health checked every 250 requests (a failed check is a crash)."""
    tally = Tally()
    kinds = list(KINDS)
    weights = [KINDS[kind][1] for kind in kinds]
    for i in _while(running, requests):
        kind = attacker.rng.choices(kinds, weights)[0]
        code, details = attacker.send(kind)
        tally.record(kind, code, details)
        progress(i + 1)
        if (i + 1) % 250 == 0:
            tally.health_checks += 1
            tally.crashes += 0 if healthy() else 1
    tally.health_checks += 1
    tally.crashes += 0 if healthy() else 1
    return tally


def _while(running: Callable[[], bool], requests: int) -> Iterator[int]:
    started = time.monotonic()
    for i in range(requests):
        if i % 50 == 0 and not running():
            raise RuntimeError(
                f"the honest run ended after {i} of {requests} hostile requests "
                f"({time.monotonic() - started:.0f} s): give it more rounds"
            )
        yield i


# --- slow clients and long strings ------------------------------------------------------------------------------


def open_train_message(attacker: Attacker) -> str | None:
    """The id of a train message of the attacked run that mallory may still answer, if it has one."""
    for message in attacker.store.open_messages_for(attacker.node):
        if (
            message.run_id == attacker.run_id
            and pb.Envelope.FromString(message.envelope).message_type == "train"
        ):
            return message.message_id
    return None


def push_long_name(
    attacker: Attacker, chars: int, key: bool = False, reply_to: str | None = None
) -> tuple[grpc.StatusCode, str, float]:
    """A reply forged on mallory's newest reply (answering `reply_to` when given) whose first tensor's name (or
    its record's key) is `chars` characters long; its status, details and seconds. Call with
    `SerialisedAgent.lock` held."""
    attacker.ready()
    forged = attacker._forged()
    if reply_to is not None:
        forged.reply_to_message_id = reply_to
    if key:
        forged.arrays[0].key = "k" * chars
    else:
        forged.arrays[0].tensors[0].name = "n" * chars
    started = time.perf_counter()
    try:
        attacker._push(forged)
        code, details = OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    return code, details, time.perf_counter() - started
