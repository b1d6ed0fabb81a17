"""Tiny real models for the Hydra-net tests (seeded; each builds in milliseconds)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from hydrafl.backbones import TinyShape, build_causal_lm
from hydrafl.data import TaskSpec
from hydrafl.models import Classifier, build_model

TEXT = TaskSpec(
    name="text",
    modality="text",
    num_classes=3,
    class_names=("a", "b", "c"),
    vocab_size=40,
    seq_len=8,
)
IMAGE = TaskSpec(
    name="image", modality="image", num_classes=2, class_names=("a", "b"), image_size=16, channels=1
)
SHAPE = TinyShape(hidden=32, layers=3, heads=4, intermediate=48, patch_size=8)
LLAMA = TinyShape(hidden=32, layers=3, heads=4, kv_heads=2, intermediate=48, max_positions=32)


@pytest.fixture
def bert():
    """hydrafl Classifier around BertForSequenceClassification: 3 layers, 4 heads of 8, hidden 32."""
    return build_model(TEXT, seed=0, shape=SHAPE)


@pytest.fixture
def vit():
    """hydrafl Classifier around ViTForImageClassification: 16 px, patch 8 (5 tokens), 3 layers, 4 heads."""
    return build_model(IMAGE, model="vit", seed=0, shape=SHAPE)


@pytest.fixture
def llama():
    """LlamaForCausalLM: 3 layers, 4 query heads / 2 KV heads of 8, hidden 32, vocab 40."""
    return build_causal_lm(40, shape=LLAMA, seed=0)


@pytest.fixture
def text_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 40, (6, 8), generator=g), torch.randint(0, 3, (6,), generator=g)


@pytest.fixture
def image_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randn(6, 1, 16, 16, generator=g), torch.randint(0, 2, (6,), generator=g)


@pytest.fixture
def lm_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 40, (4, 8), generator=g)
    return x, x


# ---------------------------------------------------------------------------------------------------------------
# A planted task: one head (PLANTED_HEAD) carries the label, by construction.
# ---------------------------------------------------------------------------------------------------------------
# Token at position 1 is A (label 1) or B (label 0); the other positions hold noise tokens. Hidden 16: dims 0-7
# hold the token's Hadamard code, dims 8-15 the position's. All codes are +-1, zero-sum, mutually orthogonal, so
# the embedding LayerNorm is exactly the identity (mean 0, variance 1, eps 1e-12 vanishes in float32).
# Head 2 (dims 8-11) queries from the CLS position, keys on position 1 (score 32 -> weight ~1) and its value
# reads the A/B code (+-1); o writes it as +-c (e0 - e1); the classifier reads z0 - z1. The other heads attend
# uniformly (q = k = 0) and their values are integer mixtures of codes orthogonal to A's, so they carry exactly
# no label information. FFN is zero.

PLANTED_HEAD = 2
PLANTED_LEN = 6


def _hadamard8() -> torch.Tensor:
    h = torch.tensor([[1.0]])
    for _ in range(3):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _planted_bert(c: float = 5.0) -> Classifier:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=4,
        max_position_embeddings=PLANTED_LEN,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    net = BertForSequenceClassification(config)
    H = _hadamard8()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        emb = net.bert.embeddings
        # tokens: 0 pad (r7), 1 CLS (r1), 2 A (r2), 3 B (-r2), 4..7 noise (r3..r6)
        codes = [H[7], H[1], H[2], -H[2], H[3], H[4], H[5], H[6]]
        for t, code in enumerate(codes):
            emb.word_embeddings.weight[t, :8] = code
        for pos in range(PLANTED_LEN):
            emb.position_embeddings.weight[pos, 8:] = H[pos + 1]
        emb.LayerNorm.weight.fill_(1.0)
        layer = net.bert.encoder.layer[0]
        att = layer.attention.self
        d = 4
        r = PLANTED_HEAD * d
        att.query.weight[r, 8:] = H[1]  # position-0 code
        att.key.weight[r, 8:] = H[2]  # position-1 code
        att.value.weight[r, :8] = H[2] / 8  # +-1 for A/B, 0 for every other token code
        others = [h for h in range(4) if h != PLANTED_HEAD]
        no_a = torch.stack([H[i] for i in (1, 3, 4, 5, 6, 7)])  # codes orthogonal to A's
        for h in others:
            for row in range(h * d, (h + 1) * d):
                coef = torch.randint(-2, 3, (6,), generator=g).float()
                att.value.weight[row, :8] = coef @ no_a
                att.value.weight[row, 8:] = torch.randint(-1, 2, (8,), generator=g).float()
        out = layer.attention.output
        out.dense.weight[:] = torch.randn(16, 16, generator=g) * 0.3
        out.dense.weight[:, r] = 0.0
        out.dense.weight[0, r], out.dense.weight[1, r] = c, -c
        for r_ in range(r + 1, r + d):
            out.dense.weight[:, r_] = 0.0
        out.LayerNorm.weight.fill_(1.0)
        layer.output.LayerNorm.weight.fill_(1.0)
        net.bert.pooler.dense.weight[:] = torch.eye(16)
        net.classifier.weight[1, 0], net.classifier.weight[1, 1] = 1.0, -1.0
        net.classifier.weight[0, 0], net.classifier.weight[0, 1] = -1.0, 1.0
    return Classifier(net, "text")


def _planted_data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 8, (n, PLANTED_LEN), generator=g)
    x[:, 0] = 1
    y = torch.randint(0, 2, (n,), generator=g)
    x[:, 1] = torch.where(y == 1, 2, 3)
    return x, y


@pytest.fixture
def planted():
    """(model, x, y, head): the planted classifier (eval mode), 64 samples, and the informative head."""
    model = _planted_bert().eval()
    x, y = _planted_data()
    return model, x, y, PLANTED_HEAD


@pytest.fixture
def lm_loss():
    return lambda model, x, y: model(input_ids=x, labels=y).loss
