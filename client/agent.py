"""The site agent: connects outbound to the coordinator, pulls messages, runs the ClientApp in-process with a
persistent Context per run, and pushes replies.

The site trusts the coordinator no more than it must. Before fetching anything it checks the message's
manifest (dtypes, shapes, sizes) and refuses arrays larger than it is willing to hold (`max_download_bytes`);
it then asks only for the missing chunks the manifest lists and refuses any chunk it did not ask for, a
repeat, one of another size than the manifest gives it or one failing its checksum (XXH3-128, or the BLAKE3
name where a manifest lists no checksums). Whatever goes wrong with one message (its content, its
chunks, the ClientApp) becomes an error reply for that message and the agent takes the next one. An error
reply's reason says what kind of failure it was, never what local data or paths caused it (those go to the
site's own log; `error_replies`). A failure for lack of disk space (the training processes' temporary files)
is said as such, "disk full", in the reply and on its own log line; the next message is served as usual, so the
site is back once space is.

Downloads fetch only the chunks the site lacks; uploads ask which chunks the coordinator already holds
first, so a retried or interrupted upload resumes instead of starting over. A dropped connection is retried
with exponential backoff; a refused token stops the agent (a revoked site must not keep knocking).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from hydrafl.client.download import (
    Assembling,
    Assembly,
    FileAssembly,
    MessageRefused,
    Received,
    take_chunks,
)
from hydrafl.client.error_replies import (
    DISK_FULL_REASON,
    disk_full,
    error_reply,
    local_reason,
    probe_bytes,
    request_of,
    size_text,
)
from hydrafl.client.exchange_folder import ExchangeFolder, default_exchange_memory_bytes
from hydrafl.client.shipped_apps import ShippedApps
from hydrafl.client.site_pipeline import answer
from hydrafl.client.site_policy import SitePolicy
from hydrafl.client.site_secagg import install_identity
from hydrafl.client.tls import SiteTls
from hydrafl.client.upload import let_go, upload_reply
from hydrafl.malloc_tuning import keep_chunk_buffers
from hydrafl.netaddr import unreachable_reason
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import (
    INLINE_BYTES,
    MAX_REASON_CHARS,
    EnvelopeError,
    check_manifest,
    chunk_sizes,
    declared_nbytes,
    join_message,
)
from hydrafl.protocol import GRPC_OPTIONS
from hydrafl.secagg.identity import SiteIdentity

log = logging.getLogger(__name__)

MIN_IDLE_POLL_S = 0.05
MAX_IDLE_POLL_S = 2.0
LONG_POLL_S = 10.0
"""How long the coordinator may hold an idle PullMessage until a message comes (it answers at once on one)."""
PULL_MARGIN_S = 30.0
"""A PullMessage's deadline beyond the wait it asks for (a coordinator that stops answering is retried)."""
STOP_CHECK_S = 0.1
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
TOO_LARGE = "larger than max"
"""What gRPC says when this site refuses to receive a message over its limit (RESOURCE_EXHAUSTED, as the
coordinator's per-site limits are; those are retried, this is final)."""
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
ENDED = ("finished", "failed", "stopped")
"""The run statuses after which the coordinator sends a run's sites nothing more."""
MAX_RUN_CONTEXTS = 4
"""Contexts kept for the most recent runs; a coordinator runs one at a time, so older ones are finished."""
TENSOR_OVERHEAD_BYTES = 4096
"""What holding one tensor costs besides its data (its header, Array and bookkeeping; measured about 2.4 KB),
counted against --max-download-mb so that a manifest of many empty tensors is bounded too."""


def default_max_download_bytes() -> int:
    """Half this machine's physical memory: a message's arrays are held as chunks and once joined."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class SiteRefused(RuntimeError):
    """The coordinator refused this site (unknown or revoked token, or a permission error)."""


class Unreachable(RuntimeError):
    """The coordinator's address cannot work (its name does not resolve): waiting will not help."""


class SiteAgent:
    def __init__(
        self,
        coordinator: str,
        token: str,
        client_app: ClientApp,
        node_config: dict,
        *,
        demo: bool = False,
        policy: SitePolicy = SitePolicy(),
        tls: SiteTls | None = None,
        max_download_bytes: int | None = None,
        inline_bytes: int = INLINE_BYTES,
        secagg_identity: SiteIdentity | None = None,
        threads: Callable[[], int] | None = None,
        apps_dir: Path | None = None,
        exchange_memory_bytes: int | None = None,
        exchange_dir: Path | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.threads = threads
        """Torch threads to train with, asked before every message (`client.machine_share`); None leaves
        torch's own choice."""
        self.inline_bytes = inline_bytes
        """Replies whose chunks total at most this go inline in PushReply; larger ones (all, with 0) stream after
        asking which chunks the coordinator already holds, so an interrupted upload resumes."""
        self.client_app = client_app
        self.node_config = dict(node_config)
        self.demo = demo
        self.policy = policy
        self.tls = tls
        self.secagg_identity = secagg_identity
        """What this site signs its secure-aggregation keys with (from its --secagg-identity file); None: it
        refuses secure-aggregation rounds."""
        self.max_download_bytes = (
            default_max_download_bytes() if max_download_bytes is None else max_download_bytes
        )
        self._download_limit_given = max_download_bytes is not None
        if self.max_download_bytes <= 0:
            raise ValueError(f"max_download_bytes must be positive, got {self.max_download_bytes}")
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.contexts: OrderedDict[int, Context] = OrderedDict()
        self.shipped = ShippedApps(policy, apps_dir)
        self.run_apps: dict[int, ClientApp | str] = {}
        """Per run (with a context): the ClientApp its bundle ships, or why the site refuses that bundle."""
        self.exchange = ExchangeFolder(
            default_exchange_memory_bytes()
            if exchange_memory_bytes is None
            else exchange_memory_bytes,
            exchange_dir,
        )
        """Where a message or reply larger than `exchange_memory_bytes` goes: files, a chunk in memory at a time."""
        self.node_id = 0
        self.received = Received()
        """What the site holds of the message in hand: a download cut by a dropped connection resumes with the rest."""
        keep_chunk_buffers()  # this process streams chunks from now on

    def run(self, stop: threading.Event | None = None, max_backoff_s: float = 30.0) -> None:
        """Serve until `stop` is set; reconnect with backoff when the coordinator is unreachable."""
        stop = stop or threading.Event()
        try:
            self._run(stop, max_backoff_s)
        finally:
            self.received.clear()  # a download file of the message in hand
            self.exchange.close()

    def _run(self, stop: threading.Event, max_backoff_s: float) -> None:
        backoff = 0.5
        while not stop.is_set():
            try:
                with self._channel() as channel:
                    self._serve(CoordinatorClient(channel), stop)
            except grpc.RpcError as error:
                code = error.code()
                if code in REFUSED:
                    raise SiteRefused(f"{code.name}: {error.details()}") from error
                if code not in RETRYABLE:
                    raise
                if code != grpc.StatusCode.UNAVAILABLE:
                    log.warning(
                        "coordinator %s: %s; retrying in %.1f s",
                        self.coordinator,
                        code.name,
                        backoff,
                    )
                else:
                    reason, waiting_helps = unreachable_reason(self.coordinator)
                    if (
                        not waiting_helps and not self.node_id
                    ):  # a typo; after a join, a resolver outage
                        raise Unreachable(
                            f"cannot reach the coordinator: {reason}; check --coordinator"
                        ) from error
                    log.warning(
                        "coordinator unreachable: %s (check --coordinator); retrying in %.1f s",
                        reason,
                        backoff,
                    )
                stop.wait(backoff)
                backoff = min(backoff * 2, max_backoff_s)

    def _channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.coordinator, options=GRPC_OPTIONS)
        return grpc.secure_channel(self.coordinator, self.tls.credentials(), options=GRPC_OPTIONS)

    def _serve(self, stub: CoordinatorClient, stop: threading.Event) -> None:
        joined = stub.Join(pb.JoinRequest(), metadata=self.metadata)
        self.node_id = joined.node_id
        if self.demo:
            self.node_config["demo-site"] = joined.site_index
        log.info("joined as %s (node %d)", joined.site_name, joined.node_id)
        idle_wait, last_run = 0.0, 0
        while not stop.is_set():
            pulled = self._pull(
                stub, pb.PullMessageRequest(last_run_id=last_run, wait_s=LONG_POLL_S), stop
            )
            if pulled is None:
                return
            if (
                not pulled.has_message
            ):  # back off while idle, so many waiting sites cost the coordinator little
                if last_run and pulled.last_run_status in ENDED:
                    log.info(
                        "run %d %s at the coordinator; waiting for the next run",
                        last_run,
                        pulled.last_run_status,
                    )
                    last_run = 0
                if (
                    pulled.poll_after_s == 0
                ):  # the coordinator waited for a message: ask again at once
                    idle_wait = 0.0
                    continue
                idle_wait = _idle_wait(pulled.poll_after_s, idle_wait)
                stop.wait(idle_wait)
                continue
            idle_wait = 0.0
            envelope = pulled.envelope
            if envelope.run_id != last_run:
                log.info("run %d: taking part", envelope.run_id)
                last_run = envelope.run_id
            reply = self._handle(stub, envelope, pulled.chunks)
            self.received.release_unless_used(reply)
            try:
                self._push(stub, reply, envelope.round)
            except grpc.RpcError as error:
                if error.code() not in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.INVALID_ARGUMENT,
                ):
                    raise
                # A late reply (round closed) or one the coordinator refused: drop it and take the next message.
                log.warning(
                    "coordinator refused the reply (%s): %s", error.code().name, error.details()
                )
            finally:  # a lost connection too: the traceback must not keep a model's worth of reply alive
                let_go(reply)
            del reply
            self.received.clear()

    def _pull(
        self, stub: CoordinatorClient, request: pb.PullMessageRequest, stop: threading.Event
    ) -> pb.PullMessageReply | None:
        """One (long) poll for the next message; None when `stop` is set while it waits (the call is cancelled)."""
        call = stub.PullMessage.future(
            request, metadata=self.metadata, timeout=request.wait_s + PULL_MARGIN_S
        )
        answered = (
            threading.Event()
        )  # wakes the site the moment a message arrives, not at the next stop check
        call.add_done_callback(lambda _: answered.set())
        while not answered.wait(STOP_CHECK_S):
            if stop.is_set():
                call.cancel()
                return None
        return call.result()

    def _handle(
        self, stub: CoordinatorClient, envelope: pb.Envelope, inline: Sequence[pb.Chunk] = ()
    ) -> Message:
        """The reply to one message: the ClientApp's after the site policy, the policy's refusal, or an error
        reply. Nothing in the message ends the agent; a lost connection or a refused token still reaches `run`."""
        request = request_of(envelope, self.node_id)
        try:
            reply = self._answer(stub, envelope, request, inline)
        except grpc.RpcError as error:
            if error.code() in RETRYABLE | REFUSED:
                raise
            log.warning(
                "message %s: fetching it failed: %s %s",
                envelope.message_id[:8],
                error.code().name,
                error.details(),
            )
            reason = f"gRPC {error.code().name} while fetching the message"
            reply = error_reply(request, ErrorCode.MESSAGE_UNAVAILABLE, reason)
        except (MessageRefused, EnvelopeError) as error:
            reason = f"{type(error).__name__}: {error}"
            log.warning(
                "message %s refused: %s", envelope.message_id[:8], reason[:MAX_REASON_CHARS]
            )
            reply = error_reply(request, ErrorCode.MOD_FAILED_PRECONDITION, reason)
        except Exception as error:  # the site's own failure: the full story stays in its log
            name = type(error).__name__
            # one line; the traceback with -v (DEBUG), where a site's operator looks for it
            log.warning(
                "message %s failed: %s: %s",
                envelope.message_id[:8],
                name,
                " ".join(str(error).split()),
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            full = disk_full(error, probe_bytes(envelope))
            if full:  # said on its own line: the operator's fix is space, not the failure above
                log.error(
                    "disk full: %s; this message fails, the site serves the next one once there is space",
                    full[1],
                )
            reason = f"disk full ({full[0]}): {DISK_FULL_REASON}" if full else local_reason(error)
            reply = error_reply(request, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason)
        reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        return reply

    def _answer(
        self,
        stub: CoordinatorClient,
        envelope: pb.Envelope,
        request: Message,
        inline: Sequence[pb.Chunk] = (),
    ) -> Message:
        context = self._context(stub, envelope.run_id)
        app = self.run_apps.get(envelope.run_id, self.client_app)
        refusal = (
            app
            if isinstance(app, str)
            else self.policy.refusal(envelope.run_id, str(context.run_config.get("strategy", "")))
        )
        if refusal:  # checked before any download: a refused run costs the site nothing
            log.warning("declining a message of run %d: %s", envelope.run_id, refusal)
            return error_reply(request, ErrorCode.MOD_FAILED_PRECONDITION, refusal)
        message = self._receive(stub, envelope, inline)
        if self.threads is not None:
            import torch  # the app trains with it: loaded by then, this costs nothing

            torch.set_num_threads(self.threads())
        assert not isinstance(app, str)  # a refused bundle returned above
        return answer(app, message, context, self.policy, self.exchange)

    def _context(self, stub: CoordinatorClient, run_id: int) -> Context:
        """The run's persistent Context, its run_config asked of the coordinator once per run."""
        if run_id in self.contexts:
            self.contexts.move_to_end(run_id)
            return self.contexts[run_id]
        joined = stub.Join(pb.JoinRequest(), metadata=self.metadata)
        context = Context(
            run_id=run_id,
            node_id=self.node_id,
            node_config=self.node_config,
            state=RecordDict(),
            run_config=parse_run_config(joined.run_config),
        )
        if self.secagg_identity is not None:
            install_identity(context, self.secagg_identity)
        self.contexts[run_id] = context
        if joined.app_bundle and joined.run_id == run_id:
            self.run_apps[run_id] = self.shipped.app_for(run_id, joined.app_bundle)
        while len(self.contexts) > MAX_RUN_CONTEXTS:
            self.run_apps.pop(self.contexts.popitem(last=False)[0], None)
        return context

    def _receive(
        self, stub: CoordinatorClient, envelope: pb.Envelope, inline: Sequence[pb.Chunk] = ()
    ) -> Message:
        """The message rebuilt from exactly the chunks its manifest lists, once its arrays are known to fit: those
        that came `inline` with it (a small message), the rest downloaded."""
        check_manifest(
            envelope
        )  # every dtype, shape and size consistent, no hostile product: nothing allocated yet
        tensors = sum(len(record.tensors) for record in envelope.arrays)
        held = declared_nbytes(envelope) + tensors * TENSOR_OVERHEAD_BYTES
        to_file = declared_nbytes(envelope) > self.exchange.memory_bytes
        limit, source = self._download_limit(to_file)
        if held > limit:
            raise MessageRefused(
                f"message declares {size_text(held)} of arrays ({tensors} tensors, counted {TENSOR_OVERHEAD_BYTES} "
                f"bytes each besides their data); this site accepts at most {size_text(limit)} ({source})"
            )
        sizes = chunk_sizes(envelope)
        self.received.keep_for(envelope)
        assembly: Assembling = (
            FileAssembly(envelope, self.received, self.exchange.path())
            if to_file
            else Assembly(envelope, self.received)
        )
        wanted = {digest: sizes[digest] for digest in assembly.missing()}
        kept = (
            sizes.keys() - wanted.keys()
        )  # filled before a dropped download: a small message brings them again
        take_chunks(
            (chunk for chunk in inline if chunk.digest not in kept), wanted, assembly
        )  # checked as downloads are
        self._fetch(stub, wanted, assembly)
        message = join_message(envelope, {}, verified=True, assembled=assembly.arrays())
        self.received.handed_over()
        return message

    def _download_limit(self, to_file: bool) -> tuple[int, str]:
        """The most a download may declare, and what sets it: --max-download-mb when given; else half the
        machine's memory in memory, and the exchange folder's free space through a file (a model larger than
        memory is what files are for)."""
        if to_file and not self._download_limit_given:
            return self.exchange.free_bytes(), "free space of its exchange folder"
        return self.max_download_bytes, "--max-download-mb"

    def _fetch(self, stub: CoordinatorClient, wanted: dict[str, int], assembly: Assembling) -> None:
        """Download the chunks `wanted` (digest -> size) into the assembly, each checked as it arrives. A chunk
        not asked for (or sent twice), of another size, or failing its check (`ChunkCheck`) refuses the message
        and ends the stream, so what is downloaded never exceeds what the manifest declares."""
        if not wanted:
            return
        pending = dict(wanted)
        call = stub.GetChunks(pb.GetChunksRequest(digests=list(wanted)), metadata=self.metadata)
        try:
            take_chunks(call, pending, assembly)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and TOO_LARGE in (
                error.details() or ""
            ):
                raise MessageRefused(
                    f"the coordinator sent a chunk over this site's message limit: {error.details()}"
                ) from error
            raise
        finally:
            call.cancel()

    def _push(self, stub: CoordinatorClient, reply: Message, server_round: int) -> None:
        spilled = self.exchange.spill(reply)
        try:
            uploaded = upload_reply(
                stub, self.metadata, reply, server_round, inline_bytes=self.inline_bytes
            )
        finally:
            if spilled is not None:
                spilled.unlink(missing_ok=True)
        if (
            uploaded.resumed
        ):  # chunks are content-addressed: an interrupted upload, or arrays the coordinator holds
            log.info(
                "upload: %d of %d chunks already at the coordinator (an interrupted upload, or arrays it holds "
                "already), sent %d",
                uploaded.already_present,
                uploaded.already_present + uploaded.stored,
                uploaded.stored,
            )
        log.debug(
            "pushed reply to %s: %s", reply.metadata.reply_to_message_id[:8], uploaded.seconds
        )


def parse_run_config(raw: bytes) -> dict[str, str | int | float | bool]:
    """A run's Flower run_config as the coordinator sent it: a flat JSON object of scalars, or refused."""
    try:
        values = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as error:
        raise MessageRefused("the run config is not valid JSON") from error
    if not isinstance(values, dict) or not all(
        isinstance(v, str | int | float | bool) for v in values.values()
    ):
        raise MessageRefused(
            "the run config is not a flat JSON object of strings, numbers and booleans"
        )
    return values


def _idle_wait(poll_after_s: float, previous: float) -> float:
    """The next idle poll's wait: what the coordinator asks, growing while idle, kept within bounds whatever
    it asks (a zero or NaN request must not make the site spin)."""
    asked = poll_after_s if math.isfinite(poll_after_s) else MAX_IDLE_POLL_S
    return min(max(asked, previous * 1.5, MIN_IDLE_POLL_S), MAX_IDLE_POLL_S)
