"""Backbones: the seeded tiny causal LM, LoRA on each family's attention projections, and offline loading."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from hydrafl.backbones import TinyShape, build_causal_lm, load_pretrained, with_lora
from hydrafl.data import TaskSpec
from hydrafl.models import build_model
from hydrafl.subnet.architecture import find_architecture

LLAMA = TinyShape(hidden=32, layers=3, heads=4, kv_heads=2, intermediate=48, max_positions=32)
SHAPE = TinyShape(hidden=32, layers=3, heads=4, intermediate=48, patch_size=8)
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


@pytest.fixture
def llama():
    return build_causal_lm(40, shape=LLAMA, seed=0)


@pytest.fixture
def lm_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 40, (4, 8), generator=g)
    return x, x


def test_tiny_causal_lm_config(llama, lm_batch):
    c = llama.config
    assert (
        c.vocab_size,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
    ) == (
        40,
        32,
        3,
        4,
        2,
    )
    assert llama(input_ids=lm_batch[0]).logits.shape == (4, 8, 40)
    again = build_causal_lm(40, shape=LLAMA, seed=0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(llama.state_dict().values(), again.state_dict().values(), strict=True)
    )
    with pytest.raises(ValueError, match="do not divide"):
        build_causal_lm(40, shape=TinyShape(hidden=32, heads=4, kv_heads=3))


def test_kv_heads_default_to_half_the_heads_when_even():
    assert (
        TinyShape().num_kv_heads,
        TinyShape(heads=3).num_kv_heads,
        TinyShape(kv_heads=1).num_kv_heads,
    ) == (2, 3, 1)


@pytest.mark.parametrize("family", ["bert", "vit", "llama"])
def test_lora_adapts_exactly_the_attention_projections_of_the_family_table(family):
    build = {
        "bert": lambda: build_model(TEXT, shape=SHAPE),
        "vit": lambda: build_model(IMAGE, model="vit", shape=SHAPE),
        "llama": lambda: build_causal_lm(40, shape=LLAMA, seed=0),
    }
    lora = with_lora(build[family](), rank=2, alpha=4)
    arch = find_architecture(lora)
    assert arch.family == family
    expected = {path for ref in arch.layers for path in (ref.q, ref.k, ref.v, ref.o)}
    assert {name for name, module in lora.named_modules() if hasattr(module, "lora_A")} == expected


def test_load_pretrained_round_trip(tmp_path, llama, lm_batch):
    llama.save_pretrained(tmp_path / "lm")
    loaded = load_pretrained(tmp_path / "lm")
    assert type(loaded) is LlamaForCausalLM
    assert loaded.config.num_key_value_heads == 2
    with torch.no_grad():
        assert torch.equal(
            loaded.eval()(input_ids=lm_batch[0]).logits, llama.eval()(input_ids=lm_batch[0]).logits
        )
    build_model(TEXT, seed=0, shape=SHAPE).net.save_pretrained(tmp_path / "bert")
    assert type(load_pretrained(tmp_path / "bert")).__name__ == "BertForSequenceClassification"
    with pytest.raises(ValueError, match="is not a local checkpoint directory"):
        load_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_pretrained(tmp_path / "empty")
