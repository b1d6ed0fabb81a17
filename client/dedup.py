"""A site's half of cross-site deduplication: keyed MinHash signatures of its training records, and the drop
list the coordinator answers with.

A record becomes a set of tokens: a note the word shingles of its token ids (SHINGLE_WORDS words each), a
table row its `column=value` pairs as recorded (before the site standardises its file); an image has no such
tokens and is refused. Every token is hashed with BLAKE2b keyed by the consortium's secret (`hydrafl site
--dedup-key-file`, which never travels) before datasketch's MinHash permutes it, so the signatures leave the site
keyed: the coordinator, without the key, cannot hash a guessed record and compare, and the same record under
another key has an unrelated signature.
The site also sends a keyed check value (an HMAC of a fixed label), so sites holding different keys are told
apart without revealing either key.

After the exchange, `deduplicated` gives the training split without the rows the coordinator listed; the list
lives in the run's `context.state`, so every later message of the run trains on the same records.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode

from hydrafl import protocol
from hydrafl.data import SiteSplit
from hydrafl.data.tokenizer import PAD_ID
from hydrafl.run_settings import message_keys

log = logging.getLogger(__name__)

SHINGLE_WORDS = 1
"""Words per shingle of a note. One word: the synthetic notes are short (a dozen to 47 words), and one changed
word changes two of a note's bigrams, which takes a short note's near copy below Jaccard 0.8; as word sets,
every near copy of the planted cohorts stays above 0.85 and unrelated notes at other sites below 0.76
(measured on 4 sites x 400 notes, seeds 0 and 1)."""
PERMUTATION_SEED = 1
"""datasketch's permutation seed, the same at every site (the key, not the seed, is the secret)."""
MAX_PERMUTATIONS = 1024
"""The most permutations a coordinator may ask for (what the site computes and sends grows with them)."""
KEY_CHECK_LABEL = b"hydrafl dedup key check"
STATE = "dedup"
"""The `context.state` ConfigRecord holding the training rows this site drops (`drop`)."""
MODALITIES = ("text", "tabular")


class DedupRefused(ValueError):
    """This site cannot take part in the deduplication step; the message says why and how to fix it."""


def consortium_key(hex_key: str) -> bytes:
    """The consortium secret from its hex text; refused without one."""
    if not hex_key:
        raise DedupRefused(
            "this site holds no consortium dedup key, so it cannot take part in the run's deduplication; "
            "start it with --dedup-key-file FILE (the secret the consortium's sites share)"
        )
    return bytes.fromhex(hex_key)


def keyed_hash(key: bytes) -> Callable[[bytes], int]:
    """A 32-bit hash of a token that only holders of `key` can compute (datasketch's `hashfunc`)."""

    def hashed(token: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(token, key=key, digest_size=4).digest(), "little")

    return hashed


def key_check(key: bytes) -> str:
    """A value equal at two sites exactly when their keys are equal, from which the key cannot be found."""
    return hmac.new(key, KEY_CHECK_LABEL, hashlib.sha256).hexdigest()


def record_tokens(row: torch.Tensor, modality: str) -> list[bytes]:
    """The set MinHash compares for one record: a note's word shingles, a row's `column=value` pairs."""
    if modality == "text":
        ids = [str(i) for i in row[row != PAD_ID].tolist()]
        width = min(SHINGLE_WORDS, len(ids))
        return [" ".join(ids[i : i + width]).encode() for i in range(len(ids) - width + 1)]
    if modality == "tabular":
        return [f"{column}={value!r}".encode() for column, value in enumerate(row.tolist())]
    raise DedupRefused(
        f"deduplication compares {' and '.join(MODALITIES)} records; this site's {modality} records have no "
        "word or column tokens to compare; run without dedup"
    )


def signatures(records: Sequence[list[bytes]], key: bytes, num_perm: int) -> np.ndarray:
    """Keyed MinHash signatures uint32 [len(records), num_perm]."""
    from datasketch import MinHash  # the dedup extra: only a run that deduplicates needs it

    hashfunc = keyed_hash(key)
    template = MinHash(num_perm, seed=PERMUTATION_SEED, hashfunc=hashfunc, scheme="affine32")
    out = np.empty((len(records), num_perm), dtype=np.uint32)
    for i, tokens in enumerate(records):
        sketch = MinHash(
            num_perm, hashfunc=hashfunc, permutations=template.permutations, scheme="affine32"
        )
        sketch.update_batch(tokens)
        out[i] = sketch.hashvalues
    return out


def site_signatures(split: SiteSplit, modality: str, key: bytes, num_perm: int) -> np.ndarray:
    """The signatures of a site's training records, in row order."""
    rows = split.train_x if split.train_records is None else split.train_records
    records = [record_tokens(row, modality) for row in rows]
    return signatures(records, key, num_perm)


def store_drop(context: Context, drop: np.ndarray, records: int) -> None:
    """Keep the coordinator's drop list for the run, once it is known to name distinct rows of this site."""
    if drop.ndim != 1 or drop.dtype.kind not in "iu":
        raise DedupRefused(f"a drop list is a 1-D integer array, got {drop.dtype} {drop.shape}")
    if drop.size and not (0 <= int(drop.min()) and int(drop.max()) < records):
        raise DedupRefused(f"the drop list names rows outside this site's {records} records")
    if np.unique(drop).size != drop.size:
        raise DedupRefused("the drop list names a row twice")
    context.state[STATE] = ConfigRecord({"drop": [int(row) for row in drop], "records": records})


def deduplicated(split: SiteSplit, context: Context) -> SiteSplit:
    """The training split without the rows the run's deduplication dropped (unchanged before it ran)."""
    stored = context.state.config_records.get(STATE)
    if stored is None or not stored["drop"]:
        return split
    keep = torch.ones(len(split.train_y), dtype=torch.bool)
    keep[torch.tensor(stored["drop"], dtype=torch.int64)] = False
    return SiteSplit(
        train_x=split.train_x[keep],
        train_y=split.train_y[keep],
        test_x=split.test_x,
        test_y=split.test_y,
        train_records=None if split.train_records is None else split.train_records[keep],
    )


def signatures_reply(message: Message, split: SiteSplit, modality: str, hex_key: str) -> Message:
    """The answer to `query.dedup_signatures`: every training record's keyed signature and the key check; a
    site without the consortium's key, or with images, declines."""
    num_perm = message_keys(message).get(protocol.DEDUP_NUM_PERM)
    if not isinstance(num_perm, int) or not 1 <= num_perm <= MAX_PERMUTATIONS:
        return _declined(message, f"dedup.num-perm must be an integer in 1..{MAX_PERMUTATIONS}")
    try:
        key = consortium_key(hex_key)
        values = site_signatures(split, modality, key, num_perm)
    except DedupRefused as error:
        return _declined(message, str(error))
    content = RecordDict(
        {
            "arrays": ArrayRecord({protocol.DEDUP_SIGNATURES: Array(values)}),
            "dedup": ConfigRecord({protocol.DEDUP_KEY_CHECK: key_check(key)}),
        }
    )
    return Message(content, reply_to=message)


def drop_reply(message: Message, context: Context, records: int) -> Message:
    """The answer to `query.dedup_drop`: the list kept for the run, and the records left."""
    drop = next(iter(message.content.array_records.values()))[protocol.DEDUP_DROP].numpy()
    try:
        store_drop(context, drop, records)
    except DedupRefused as error:
        return _declined(message, str(error))
    log.info("dedup: dropping %d of %d training records", drop.size, records)
    metrics = MetricRecord(
        {protocol.DEDUP_DROPPED: int(drop.size), protocol.WEIGHT: records - int(drop.size)}
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


def _declined(message: Message, reason: str) -> Message:
    log.warning("declining a %s message: %s", message.metadata.message_type, reason)
    return Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, reason), reply_to=message)
