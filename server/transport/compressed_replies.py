"""Compressed train replies (`--compress`), checked at the edge against the message the coordinator sent that
site. The scheme is the one the sent message's run config names, never the reply's own say; every tensor the
reply declares is a float32 tensor the site was sent (same rank, no axis longer: the whole tensor or a
subnetwork's slice); its arrays are exactly the scheme's layout for those shapes (`hydrafl.compression.layout`:
names, dtypes and lengths all computed before a byte is read), so their size follows from what was sent; and
their values decode to finite numbers (bfloat16 exponents, top-k indices inside the update). The round driver
decodes what is accepted (`hydrafl.compression.receive`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from hydrafl.compression.layout import (
    DOWNLOAD_RECORD,
    PREFIX,
    RECORD,
    CompressionError,
    Scheme,
    check_layout,
    check_values,
    download_shapes,
    read_description,
)
from hydrafl.proto.coordinator_pb2 import Envelope
from hydrafl.proto.envelope import EnvelopeError

CHECKED_VALUES = (PREFIX + "bf16", PREFIX + "index")
"""The arrays whose values are checked here; float parts are checked for NaN/Inf like any float array."""


def is_compressed(content: RecordDict) -> bool:
    """A reply that says it is compressed (it is then held to the scheme the coordinator sent)."""
    return isinstance(content.get(RECORD) if RECORD in content else None, ConfigRecord)


def sent_model(sent: Envelope, sent_content: RecordDict) -> dict[str, tuple[str, list[int]]]:
    """(dtype, shape) of each model tensor a message stands for, what a reply to it may carry: its arrays, or
    those of the model its compressed download changes."""
    downloaded = download_model(sent_content)
    if downloaded is not None:
        return {name: ("float32", list(shape)) for name, shape in downloaded.items()}
    return {t.name: (t.dtype, list(t.shape)) for record in sent.arrays for t in record.tensors}


def download_model(sent_content: RecordDict) -> dict[str, tuple[int, ...]] | None:
    """The float32 tensors a compressed download (`--compress-downloads`: a change to the site's reference
    model, its arrays packed) stands for, as its download record declares them; None for any other message."""
    download = sent_content.get(DOWNLOAD_RECORD) if DOWNLOAD_RECORD in sent_content else None
    if not isinstance(download, ConfigRecord) or download.get("mode") != "delta":
        return None
    try:
        return download_shapes(_sent_scheme(sent_content), dict(download))
    except CompressionError as error:
        raise EnvelopeError(f"compressed download: {error}") from None


def check_compressed_layout(
    reply: Envelope, content: RecordDict, sent: Envelope, sent_content: RecordDict
) -> None:
    """Raise EnvelopeError unless `reply` declares a compressed update in the scheme `sent` asked for, over
    tensors it carried, in exactly the scheme's arrays. Call it after the records check (one ArrayRecord, one
    MetricRecord); nothing is read but the manifest."""
    try:
        scheme, shapes = _declared(content, sent_content)
        if sent.message_type != "train":
            raise CompressionError("only a train reply may be compressed")
        sent_shapes = sent_model(sent, sent_content)
        for name, shape in shapes.items():
            dtype, bound = sent_shapes.get(name, (None, []))
            fits = len(shape) == len(bound) and all(
                n <= m for n, m in zip(shape, bound, strict=True)
            )
            if dtype != "float32" or not fits:
                raise CompressionError(
                    f"tensor {name!r} of shape {list(shape)} is not (a slice of) a float32 tensor sent"
                )
        arrays = {
            t.name: (t.dtype, tuple(t.shape)) for record in reply.arrays for t in record.tensors
        }
        check_layout(scheme, shapes, arrays)
    except CompressionError as error:
        raise EnvelopeError(f"compressed update: {error}") from None


def check_compressed_values(
    reply: Envelope,
    content: RecordDict,
    sent_content: RecordDict,
    chunk_bytes: Callable[[str], bytes],
) -> None:
    """Raise EnvelopeError unless the bfloat16 bits and top-k indices decode to finite values inside the update.
    Call it after the layout and chunk-size checks (each chunk then holds whole values: 1 MiB is a multiple of 4)."""
    try:
        _, shapes = _declared(content, sent_content)
        total = sum(math.prod(shape) for shape in shapes.values())
        for tensor in (
            t for record in reply.arrays for t in record.tensors if t.name in CHECKED_VALUES
        ):
            for digest in tensor.chunk_digests:
                check_values(
                    tensor.name, np.frombuffer(chunk_bytes(digest), dtype=tensor.dtype), total
                )
    except CompressionError as error:
        raise EnvelopeError(f"compressed update: {error}") from None


def _declared(
    content: RecordDict, sent_content: RecordDict
) -> tuple[Scheme, dict[str, tuple[int, ...]]]:
    """The scheme the sent message asked for and the tensors' shapes the reply declares in it."""
    scheme = _sent_scheme(sent_content)
    if not scheme.enabled:
        raise CompressionError(
            "the reply is compressed; the message it answers asked for no compression"
        )
    return scheme, read_description(scheme, dict(content[RECORD]))


def _sent_scheme(sent_content: RecordDict) -> Scheme:
    """The scheme the run config of the sent message names (none when it names none)."""
    configs = [
        record
        for record in sent_content.values()
        if isinstance(record, ConfigRecord) and "compress" in record
    ]
    return Scheme.from_config(configs[0]) if configs else Scheme()
