"""Synthetic "clinical-notes-lm": next-token prediction on the clinical-text cohort's admission notes.

The notes are exactly those of `text_cohort` (same generator, same seed streams), so the per-site shift is the
one that cohort already has: every hospital writes with its own abbreviations, headers, negation and filler
words, and a language model trained at one site meets unfamiliar continuations elsewhere. Each row is one note
as `SEQ_LEN` token ids of the shared hashing tokenizer (CLS first, right-padded); its target row holds the next
token at every position and `IGNORE_INDEX` where there is none (the last real token and the padding).
"""

from __future__ import annotations

import numpy as np
import torch

from hydrafl.catalog import NEXT_TOKEN_TASKS
from hydrafl.data.schema import TaskSpec
from hydrafl.data.text_cohort import site_notes
from hydrafl.data.tokenizer import PAD_ID, SEQ_LEN, VOCAB_SIZE, tokenize

TASK = NEXT_TOKEN_TASKS[0]
NEXT_TOKEN = "next-token"
IGNORE_INDEX = -100
"""Target of positions without a next token (the `ignore_index` of the loss kernels)."""


def task_spec() -> TaskSpec:
    return TaskSpec(
        name=TASK,
        modality="text",
        objective=NEXT_TOKEN,
        num_classes=VOCAB_SIZE,
        class_names=(),
        vocab_size=VOCAB_SIZE,
        seq_len=SEQ_LEN,
    )


def next_token_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [N, T] and targets [N, T] from token ids [N, T + 1]: the target of position t is token t + 1,
    IGNORE_INDEX where that is padding."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[targets == PAD_ID] = IGNORE_INDEX
    return inputs.contiguous(), targets


def generate_site(seed: int, site: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids int64 [n, SEQ_LEN] and next-token targets int64 [n, SEQ_LEN] for one hospital."""
    notes, _ = site_notes(seed, site, n)
    inputs, targets = next_token_targets(tokenize(notes, VOCAB_SIZE, SEQ_LEN + 1))
    return inputs.numpy(), targets.numpy()
