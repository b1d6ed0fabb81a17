"""A stable hashing word tokenizer, so text from any hospital maps to the same ids without a shared vocabulary.

Hashing (zlib.crc32, not Python's salted `hash`) gives identical ids across processes and machines, which
federated training needs: every site must agree on what embedding row a word uses.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

import torch

from hydrafl.data.schema import DataError

VOCAB_SIZE = 2048  # default for synthetic notes and text files alike
SEQ_LEN = 48
PAD_ID = 0
CLS_ID = 1
UNK_ID = 2  # reserved; hashing gives every word a bucket, so the tokenizer itself never emits it
NUM_SPECIAL = 3

_WORD = re.compile(r"[^\W_]+")


def tokenize(texts: Sequence[str], vocab_size: int, seq_len: int) -> torch.Tensor:
    """Token ids int64 [len(texts), seq_len]: CLS, then hashed lowercase words, truncated or PAD-padded."""
    if vocab_size <= NUM_SPECIAL:
        raise DataError(
            f"vocab_size must be greater than {NUM_SPECIAL} (ids 0-2 are PAD, CLS, UNK); got {vocab_size}"
        )
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1 (room for the CLS token); got {seq_len}")
    buckets = vocab_size - NUM_SPECIAL
    cache: dict[str, int] = {}
    rows = []
    for text in texts:
        tokens = [CLS_ID]
        for word in _WORD.findall(text.lower())[: seq_len - 1]:
            token = cache.get(word)
            if token is None:
                token = cache[word] = zlib.crc32(word.encode("utf-8")) % buckets + NUM_SPECIAL
            tokens.append(token)
        rows.append(tokens + [PAD_ID] * (seq_len - len(tokens)))
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), seq_len)
