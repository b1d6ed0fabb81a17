"""Secure-aggregation replies, checked at the edge against the message the coordinator sent that site: signed
key material of the right sizes, encrypted shares addressed to exactly the neighbours the site was given (never
to itself or to a site outside its round), a survivor-set signature of the right size, unmasking shares of the
right size, and a masked vector of the one length and dtype the round expects, with nothing in the clear beside
it (train and evaluate replies alike). A reply that fails is refused
before it is stored."""

from __future__ import annotations

from flwr.app import ConfigRecord, RecordDict

from hydrafl import protocol
from hydrafl.proto.coordinator_pb2 import Envelope
from hydrafl.proto.envelope import EnvelopeError, parse_content
from hydrafl.secagg import SecAggError, shamir, wire
from hydrafl.secagg.identity import SIGNATURE_BYTES
from hydrafl.secagg.site import SEALED_BYTES


def is_secagg(message_type: str, sent: RecordDict) -> bool:
    """A protocol query, or a train or evaluate message that carries the shares routed to its site."""
    return message_type in protocol.SECAGG_QUERIES or (
        message_type in MASKED_KINDS and protocol.SECAGG_RECORD in sent
    )


MASKED_KINDS = ("train", "evaluate")
"""Messages whose reply, under secure aggregation, is one masked vector and nothing else."""


def secagg_length(sent: Envelope) -> int | None:
    """The masked vector's length a secure-aggregation train or evaluate message asks for; None for any other."""
    content = parse_content(sent)
    record = content.get(protocol.SECAGG_RECORD) if protocol.SECAGG_RECORD in content else None
    length = (
        record.get("length") if isinstance(record, ConfigRecord) and "length" in record else None
    )
    return length if type(length) is int and length > 0 else None


def check_secagg_reply(
    reply: Envelope, content: RecordDict, message_type: str, sent: RecordDict
) -> None:
    """Raise EnvelopeError unless `reply` is what this stage allows in answer to `sent`."""
    try:
        request = sent.config_records[protocol.SECAGG_RECORD]
        if message_type in MASKED_KINDS:
            _check_masked(reply, content, request)
            return
        record = content.get(protocol.SECAGG_RECORD) if protocol.SECAGG_RECORD in content else None
        if reply.arrays or len(content) != 1 or not isinstance(record, ConfigRecord):
            raise EnvelopeError(
                f"a {message_type} reply holds its one secure-aggregation ConfigRecord and nothing else"
            )
        if message_type == protocol.QUERY_SECAGG_KEYS:
            wire.parse_keys_reply(record).check_sizes()
        elif message_type == protocol.QUERY_SECAGG_SHARES:
            node, keys = wire.parse_shares_request(request)
            sealed = wire.parse_sealed(record)
            if set(sealed) != set(keys) - {node}:
                raise EnvelopeError(
                    f"encrypted shares addressed to {sorted(sealed)}; the site's neighbours are "
                    f"{sorted(set(keys) - {node})}"
                )
            if any(len(blob) != SEALED_BYTES for blob in sealed.values()):
                raise EnvelopeError(f"every encrypted share must be {SEALED_BYTES} bytes")
        elif message_type == protocol.QUERY_SECAGG_CHECK:
            if len(wire.parse_check_reply(record)) != SIGNATURE_BYTES:
                raise EnvelopeError(f"a survivor-set signature must be {SIGNATURE_BYTES} bytes")
        else:
            revealed = wire.parse_unmask_reply(record)
            if any(len(share) != shamir.SHARE_BYTES for share in revealed.values()):
                raise EnvelopeError(f"every unmasking share must be {shamir.SHARE_BYTES} bytes")
    except SecAggError as error:
        raise EnvelopeError(f"secure aggregation: {error}") from None


def _check_masked(reply: Envelope, content: RecordDict, request: ConfigRecord) -> None:
    """One array, `secagg.masked`, uint32 of the round's length, and nothing else: the weight and the metrics are
    inside the sum, so a reply carrying any MetricRecord or ConfigRecord in the clear is refused."""
    length = request.get("length") if "length" in request else None
    tensors = [tensor for record in reply.arrays for tensor in record.tensors]
    if (
        len(reply.arrays) != 1
        or len(tensors) != 1
        or tensors[0].name != protocol.SECAGG_MASKED
        or tensors[0].dtype != "uint32"
        or list(tensors[0].shape) != [length]
    ):
        raise EnvelopeError(
            f"a secure-aggregation reply holds one array {protocol.SECAGG_MASKED!r}, uint32 "
            f"of shape [{length!r}]"
        )
    if content.metric_records or content.config_records:
        raise EnvelopeError(
            "a secure-aggregation reply carries nothing in the clear besides its masked vector "
            "(no MetricRecord or ConfigRecord)"
        )
