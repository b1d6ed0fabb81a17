"""An in-process Flower `Grid`: virtual sites that live in this process, each with a persistent Context.

No Ray, no sockets. Every message still crosses a serialisation boundary (Flower's own protobuf form), so a
ClientApp can never mutate the server's arrays and what runs here behaves as it would on a real wire.
`send_and_receive` runs the sites one after another in node order and yields each reply as soon as its site
finishes: the round driver aggregates it before the next site runs (the server holds one reply at a time), and
the fixed order keeps aggregation order (and therefore floating-point sums) deterministic. With `workers` > 1
the sites run in that many forked worker processes (`hydrafl.simulation.workers`), a few sites ahead of the
reply being consumed, and the replies still come in node order: the same sums, bit for bit. With `pooled_site`,
one more site (`reference_node`, never listed by `get_node_ids`, so strategies never sample it) holds every
site's training data: the full-data reference of the pseudo-gradient diagnostics. Every site holds the
simulated consortium's deduplication key (`simulated_dedup_key`), as real sites hold theirs.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from hydrafl.client.site_pipeline import answer
from hydrafl.client.site_policy import SitePolicy
from hydrafl.client.site_secagg import install_identity
from hydrafl.identity import claim_server_identity
from hydrafl.secagg.identity import SiteIdentity, new_signing_key
from hydrafl.simulation.workers import Job, WorkerPool, emit_logs, make_job, worker_count

log = logging.getLogger(__name__)

FIRST_NODE_ID = 1001
POOLED_NODE_ID = 1000


def simulated_dedup_key(seed: int) -> str:
    """The simulated consortium's deduplication key (hex), from the run's seed: same seed, same signatures, so
    the same records dropped. A secret only in name: the simulation is one process."""
    return hashlib.blake2b(
        f"hydrafl simulated dedup key {seed}".encode(), digest_size=32
    ).hexdigest()


class InProcessGrid(Grid):
    """Runs `client_app` for each pushed message, synchronously, in this process (or in `workers` forked worker
    processes; 0: one per core); every site's replies pass `policy`, as a real site's pass its operator's.
    `close` (or leaving a `with` block) ends the workers."""

    def __init__(
        self,
        client_app: ClientApp,
        num_sites: int,
        run_config: dict | None = None,
        *,
        run_id: int = 1,
        pooled_site: bool = False,
        policy: SitePolicy = SitePolicy(),
        workers: int = 1,
    ) -> None:
        if num_sites < 1:
            raise ValueError(f"num_sites must be >= 1, got {num_sites}")
        self.client_app = client_app
        self.policy = policy
        self.workers = worker_count(workers, num_sites)
        self._pool: WorkerPool | None = None
        self._run = replace(Run.create_empty(run_id), override_config=dict(run_config or {}))
        dedup_key = simulated_dedup_key(int((run_config or {}).get("seed", 0)))
        self.contexts = {
            FIRST_NODE_ID + i: Context(
                run_id=run_id,
                node_id=FIRST_NODE_ID + i,
                node_config={
                    "partition-id": i,
                    "num-partitions": num_sites,
                    "dedup-key": dedup_key,
                },
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i in range(num_sites)
        }
        consortium = (
            new_signing_key()
        )  # the simulation certifies its own sites' secure-aggregation keys
        for node, context in self.contexts.items():
            install_identity(context, SiteIdentity.issue(consortium, node))
        self.reference_node: int | None = POOLED_NODE_ID if pooled_site else None
        self._pooled: dict[int, Context] = {}
        if pooled_site:  # partition-id one past the sites': its own data order
            self._pooled[POOLED_NODE_ID] = Context(
                run_id=run_id,
                node_id=POOLED_NODE_ID,
                node_config={
                    "pooled": True,
                    "partition-id": num_sites,
                    "num-partitions": num_sites,
                },
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
        self._replies: dict[str, Message] = {}
        self._next_message_id = 0
        claim_server_identity(self._run.run_id)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return replace(self._run)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        message_ids = []
        for message, reply in zip(messages, self._replies_to(messages), strict=True):
            self._replies[message.metadata.message_id] = reply
            message_ids.append(message.metadata.message_id)
        return message_ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [
            self._replies.pop(message_id)
            for message_id in message_ids
            if message_id in self._replies
        ]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterator[Message]:
        """Each site's reply as soon as its site has run, sites in node order. Lazy: a site runs when its reply
        is asked for, so only the reply being consumed is held (with workers, the replies of the few sites run
        ahead). Every site answers, so `timeout` never applies."""
        yield from self._replies_to(
            sorted(messages, key=lambda message: message.metadata.dst_node_id)
        )

    def close(self) -> None:
        """End the worker processes, if any ran; a later message starts new ones."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> InProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _replies_to(self, messages: list[Message]) -> Iterator[Message]:
        """The reply to each of `messages`, in their order, each message given its id just before its site runs."""
        if self.workers == 1:
            for message in messages:
                self._stamp(message)
                yield self._deliver(message)
            return
        if (
            self._pool is None
        ):  # forked now, so the workers inherit the app and whatever the run cached so far
            self._pool = WorkerPool(self.workers, self._answer)
        sent: deque[tuple[Message, Context | None, str]] = deque()

        def jobs() -> Iterator[Job | None]:
            for (
                message
            ) in messages:  # ids as the sequential grid gives them: message, then its reply
                self._stamp(message)
                context = self._context_of(message)
                sent.append((message, context, self._new_message_id()))
                yield None if context is None else make_job(message, context)

        for result in self._pool.run(jobs()):
            message, context, reply_id = sent.popleft()
            if result is None or context is None:
                reply = _wire_copy(_unavailable(message))
            elif result.crash:
                log.warning("site %d failed: %s", context.node_id, result.crash)
                reply = _wire_copy(
                    Message(Error(ErrorCode.CLIENT_APP_CRASHED, result.crash), reply_to=message)
                )
            else:
                emit_logs(result.logs)
                result.apply_state(context)
                reply = result.reply_message()
            reply.metadata.__dict__["_message_id"] = reply_id
            yield reply

    def _stamp(self, message: Message) -> str:
        """Give a pushed message its id, as a real grid does."""
        message_id = self._new_message_id()
        message.metadata.__dict__["_message_id"] = message_id
        return message_id

    def _new_message_id(self) -> str:
        self._next_message_id += 1
        return f"{self._run.run_id}-{self._next_message_id}"

    def _context_of(self, message: Message) -> Context | None:
        node = message.metadata.dst_node_id
        return self.contexts.get(node) or self._pooled.get(node)

    def _deliver(self, message: Message) -> Message:
        """One round trip: serialise, run the site's ClientApp, serialise the reply back."""
        context = self._context_of(message)
        reply = (
            _unavailable(message) if context is None else self._answer(_wire_copy(message), context)
        )
        reply.metadata.__dict__["_message_id"] = self._new_message_id()
        return _wire_copy(reply)

    def _answer(self, received: Message, context: Context) -> Message:
        """The site's reply to a message it received (run here, or in a worker process)."""
        try:
            return answer(self.client_app, received, context, self.policy)
        except Exception as error:  # a site's crash becomes an error reply, as on a real deployment
            log.warning("site %d raised %s: %s", context.node_id, type(error).__name__, error)
            return Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(error).__name__}: {error}"),
                reply_to=received,
            )
        finally:
            claim_server_identity(self._run.run_id)


def _unavailable(message: Message) -> Message:
    return Message(
        Error(ErrorCode.NODE_UNAVAILABLE, f"no site with node id {message.metadata.dst_node_id}"),
        reply_to=message,
    )


def _wire_copy(message: Message) -> Message:
    return message_from_proto(
        ProtoMessage.FromString(message_to_proto(message).SerializeToString())
    )
