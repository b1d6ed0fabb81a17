"""What a site's reply may be, checked completely at the edge before it is accepted: everything accepted can be
decoded and aggregated, so one site can never fail a round for the others.

The reference is the message the coordinator stored for that site, never a field the site sends: the reply's
type is the request's type; its arrays travel only through the manifest, each one a tensor the site was sent
(same dtype and rank, no axis longer) or, in reply to a message that carried no arrays (the initial model), at
most `SiteLimits.max_model_bytes`; its metrics are finite numbers with a positive weight. A compressed train
reply is held to its scheme's exact layout instead (`compressed_replies`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from flwr.app import RecordDict

from hydrafl.bounded import bounded
from hydrafl.proto.coordinator_pb2 import Envelope
from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    MAX_REASON_CHARS,
    EnvelopeError,
    check_manifest,
    chunk_sizes,
    declared_nbytes,
    parse_content,
)
from hydrafl.server.tables import AuditEvent, OutboundMessage, Site
from hydrafl.server.transport.compressed_replies import (
    check_compressed_layout,
    check_compressed_values,
    download_model,
    is_compressed,
    sent_model,
)
from hydrafl.server.transport.secagg_replies import check_secagg_reply, is_secagg, secagg_length
from hydrafl.updates import InvalidUpdate, check_metrics, declared_reply_arrays


def allowed_reply_bytes(
    sent: Envelope, max_model_bytes: int, sent_content: RecordDict | None = None
) -> int:
    """The most array bytes a reply to `sent` may carry: the model it stands for (what was sent, or what a
    compressed download changes), or, for a query that sent no arrays (the initial model), the coordinator's
    model limit; evaluate replies carry none (under secure aggregation, their masked vector).
    `sent_content`: `sent`'s records, when the caller has parsed them."""
    kind = message_kind(sent.message_type)
    if kind in ("train", "evaluate") and (length := secagg_length(sent)) is not None:
        return 4 * length  # a masked uint32 vector, whatever the site was sent
    if kind == "evaluate":
        return 0
    content = parse_content(sent) if sent_content is None else sent_content
    downloaded = download_model(content)
    sent_bytes = (
        declared_nbytes(sent)
        if downloaded is None
        else sum(4 * math.prod(s) for s in downloaded.values())
    )
    if (
        sent_bytes
    ):  # a train reply's declared extra records (SCAFFOLD's) each stand for the model too
        return sent_bytes * (1 + len(declared_reply_arrays(content)) if kind == "train" else 1)
    return max_model_bytes if kind == "query" else 0


QUERY_REPLY_ARRAYS = 4096
"""Arrays a reply may carry when the message it answers carried none (the initial model): more tensors than any
transformer has (a 70B-parameter LLaMA has 723)."""
LAYOUT_ARRAYS = 3
"""The most arrays a compressed or secure reply packs its tensors into (PowerSGD's p, q and raw)."""


def allowed_reply_chunks(sent: Envelope, max_model_bytes: int) -> int:
    """The most chunks a reply to `sent` may upload: its allowed bytes in whole chunks, plus a partly filled last
    chunk for each array it may carry. Bounded apart from bytes because every stored chunk takes a whole pack slot
    on disk (`server.packs`), however few bytes it holds."""
    sent_content = parse_content(sent)
    nbytes = allowed_reply_bytes(sent, max_model_bytes, sent_content)
    if not nbytes:
        return 0
    tensors = len(sent_model(sent, sent_content))
    if not tensors and message_kind(sent.message_type) == "query":
        tensors = QUERY_REPLY_ARRAYS
    if message_kind(sent.message_type) == "train":  # each declared extra record repeats the tensors
        tensors *= 1 + len(declared_reply_arrays(sent_content))
    return math.ceil(nbytes / CHUNK_BYTES) + max(tensors, LAYOUT_ARRAYS)


def message_kind(message_type: str) -> str:
    """train, evaluate or query (Flower message types may carry an action: `query.init`)."""
    return message_type.partition(".")[0]


def check_reply(
    reply: Envelope,
    sent: Envelope,
    *,
    chunk_size: Callable[[str], int],
    chunk_bytes: Callable[[str], bytes],
    weighted_by_key: str,
    max_model_bytes: int,
    known_finite: Callable[[str], bool] = lambda digest: False,
) -> None:
    """Raise EnvelopeError unless `reply` is a reply to `sent` that the round can decode and aggregate.
    `chunk_size`/`chunk_bytes` read the replying site's own uploads (KeyError or OSError when absent);
    `known_finite` names the chunks already known to hold only finite float32 values (not read again)."""
    if reply.error_code or reply.error_reason:
        if reply.content or reply.arrays:
            raise EnvelopeError("an error reply carries no content or arrays")
        return
    check_manifest(reply)
    content = parse_content(reply)
    sent_content = parse_content(sent)
    if is_secagg(sent.message_type, sent_content):  # its own records, sizes and addresses
        check_secagg_reply(reply, content, sent.message_type, sent_content)
        _check_chunks(reply, chunk_size, chunk_bytes, known_finite)
        return
    _check_records(content, reply, sent.message_type, weighted_by_key, sent_content)
    compressed = is_compressed(content)
    if (
        compressed
    ):  # packed arrays of the run's scheme, held to its exact layout for the tensors sent
        check_compressed_layout(reply, content, sent, sent_content)
    else:
        limit = allowed_reply_bytes(sent, max_model_bytes, sent_content)
        _check_against_sent(reply, sent_model(sent, sent_content), limit)
    _check_chunks(reply, chunk_size, chunk_bytes, known_finite)
    if compressed:
        check_compressed_values(reply, content, sent_content, chunk_bytes)


def _check_records(
    content: RecordDict,
    reply: Envelope,
    message_type: str,
    weighted_by_key: str,
    sent_content: RecordDict,
) -> None:
    """Only the records a reply of this type may hold: train one ArrayRecord (the delta, first) and exactly the
    extra ones its message declares (`updates.declared_reply_arrays`) and one MetricRecord, evaluate one
    MetricRecord and no arrays, a query at most one ArrayRecord; ConfigRecords anywhere."""
    arrays, metrics, kind = len(reply.arrays), content.metric_records, message_kind(message_type)
    extra = declared_reply_arrays(sent_content) if kind == "train" else ()
    if kind == "train" and (arrays != 1 + len(extra) or len(metrics) != 1):
        raise EnvelopeError(
            f"a train reply holds {1 + len(extra)} ArrayRecord(s) and one MetricRecord, not {arrays} and "
            f"{len(metrics)}"
        )
    keys = [record.key for record in reply.arrays]
    if kind == "train" and (keys[0] in extra or sorted(keys[1:]) != sorted(extra)):
        raise EnvelopeError(f"a train reply holds its delta, then ArrayRecords {list(extra)}")
    if kind == "evaluate" and (arrays or len(metrics) != 1):
        raise EnvelopeError(
            f"an evaluate reply holds one MetricRecord and no arrays, not {len(metrics)} and {arrays}"
        )
    if kind == "query" and arrays > 1:
        raise EnvelopeError(f"a query reply holds at most one ArrayRecord, not {arrays}")
    try:
        for record in metrics.values():
            check_metrics(record, weighted_by_key if kind in ("train", "evaluate") else None)
    except InvalidUpdate as error:
        raise EnvelopeError(str(error)) from None


def _check_against_sent(
    reply: Envelope, shapes: dict[str, tuple[str, list[int]]], limit: int
) -> None:
    """Each tensor is one of the model the site was sent (`shapes`: dtype, rank, no longer along any axis: the
    whole tensor or the slice a subnetwork trained; which slice is the strategy's check), and the reply is no
    larger than `limit`."""
    for record in reply.arrays if shapes else ():
        for tensor in record.tensors:
            if tensor.name not in shapes:
                raise EnvelopeError(f"array {tensor.name}: not a tensor this site was sent")
            dtype, shape = shapes[tensor.name]
            fits = len(tensor.shape) == len(shape) and all(
                0 <= n <= m for n, m in zip(tensor.shape, shape, strict=True)
            )
            if tensor.dtype != dtype or not fits:
                raise EnvelopeError(
                    f"array {tensor.name}: shape {list(tensor.shape)} {tensor.dtype} does not fit in shape {shape} "
                    f"{dtype} of the array sent"
                )
    total = declared_nbytes(reply)
    if total > limit:  # e.g. one tensor listed in several records, or arrays where none may be
        raise EnvelopeError(
            f"the reply declares {total} bytes of arrays; a reply to this message may carry {limit}"
        )


def _check_chunks(
    reply: Envelope,
    chunk_size: Callable[[str], int],
    chunk_bytes: Callable[[str], bytes],
    known_finite: Callable[[str], bool],
) -> None:
    """Every chunk uploaded with the size the manifest gives it, float values finite. Each distinct chunk is
    read once per dtype, one at a time: the coordinator never holds a whole update to check it, and listing one
    chunk many times costs nothing extra (chunks were verified against their hashes when stored)."""
    for digest, size in chunk_sizes(reply).items():
        try:
            stored = chunk_size(digest)
        except (KeyError, OSError):
            raise EnvelopeError(f"chunk {digest[:12]} was not uploaded") from None
        if stored != size:
            raise EnvelopeError(
                f"chunk {digest[:12]} holds {stored} bytes; its manifest makes it {size}"
            )
    finite: set[tuple[str, str]] = set()
    for record in reply.arrays:
        for tensor in record.tensors:
            dtype = np.dtype(tensor.dtype)
            for digest in tensor.chunk_digests if dtype.kind == "f" else ():
                if (digest, tensor.dtype) not in finite and not (
                    dtype == np.float32 and known_finite(digest)
                ):
                    if not np.isfinite(np.frombuffer(chunk_bytes(digest), dtype=dtype)).all():
                        raise EnvelopeError(f"array {record.key}/{tensor.name} contains NaN or Inf")
                    finite.add((digest, tensor.dtype))


def reply_event(site: Site, outbound: OutboundMessage, stored: Envelope) -> AuditEvent:
    """The audit event of a stored reply: an accepted update, or the site's declining with its reason."""
    if stored.error_reason or stored.error_code:
        detail = bounded(
            f"round {outbound.server_round} {stored.message_type}: {stored.error_reason}"
        )
        return AuditEvent(
            kind="site-declined", site_name=site.name, run_id=outbound.run_id, detail=detail
        )
    return AuditEvent(
        kind="update-accepted",
        site_name=site.name,
        run_id=outbound.run_id,
        detail=outbound.message_id,
    )


def as_stored(reply: Envelope, outbound: OutboundMessage, sent: Envelope) -> Envelope:
    """The reply as the coordinator keeps it: identity from the message it answers, never from the site."""
    stored = Envelope(
        message_id=f"{outbound.message_id}.reply",
        reply_to_message_id=outbound.message_id,
        message_type=sent.message_type,
        run_id=outbound.run_id,
        round=outbound.server_round,
    )
    if reply.error_code or reply.error_reason:
        stored.error_code = reply.error_code or 1
        stored.error_reason = reply.error_reason[:MAX_REASON_CHARS]
    else:
        stored.content = reply.content
        stored.arrays.extend(reply.arrays)
    return stored
