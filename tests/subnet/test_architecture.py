"""The adapter finds the real module names of BERT, ViT and Llama, plain and under PEFT LoRA."""

from __future__ import annotations

import pytest
from torch import nn

from hydrafl.backbones import with_lora
from hydrafl.subnet.architecture import find_architecture


def _names(arch, i):
    ref = arch.layers[i]
    return ref.name, ref.attention, ref.q, ref.k, ref.v, ref.o


def test_bert_inside_the_classifier(bert):
    arch = find_architecture(bert)
    assert (
        arch.family,
        arch.num_layers,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.hidden_size,
    ) == (
        "bert",
        3,
        4,
        4,
        8,
        32,
    )
    assert arch.group_size == 1 and arch.num_groups == 4
    b = "net.bert.encoder.layer.2"
    assert _names(arch, 2) == (
        b,
        f"{b}.attention.self",
        f"{b}.attention.self.query",
        f"{b}.attention.self.key",
        f"{b}.attention.self.value",
        f"{b}.attention.output.dense",
    )
    params = dict(bert.named_parameters())
    assert params[f"{b}.attention.output.dense.weight"].shape == (32, 32)


def test_vit_uses_transformers5_names(vit):
    arch = find_architecture(vit)
    assert (arch.family, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        "vit",
        3,
        4,
        4,
        8,
    )
    b = "net.vit.layers.1"
    assert _names(arch, 1) == (
        b,
        f"{b}.attention",
        f"{b}.attention.q_proj",
        f"{b}.attention.k_proj",
        f"{b}.attention.v_proj",
        f"{b}.attention.o_proj",
    )


def test_llama_grouped_query_attention(llama):
    arch = find_architecture(llama)
    assert (arch.family, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        "llama",
        3,
        4,
        2,
        8,
    )
    assert arch.group_size == 2 and arch.num_groups == 2
    assert list(arch.query_heads(1)) == [2, 3]
    assert arch.query_dims([1]) == list(range(16, 32))
    assert arch.kv_dims([1]) == list(range(8, 16))
    b = "model.layers.0"
    assert _names(arch, 0) == (
        b,
        f"{b}.self_attn",
        f"{b}.self_attn.q_proj",
        f"{b}.self_attn.k_proj",
        f"{b}.self_attn.v_proj",
        f"{b}.self_attn.o_proj",
    )
    assert arch.layer_of("model.layers.2.mlp.up_proj.weight") == 2
    assert arch.layer_of("model.norm.weight") is None
    assert arch.layer_of("lm_head.weight") is None


@pytest.mark.parametrize(
    ("fixture", "layer_name", "o_suffix", "trainable_outside"),
    [
        ("llama", "base_model.model.model.layers.1", "self_attn.o_proj", []),
        (
            "bert",
            "base_model.model.net.bert.encoder.layer.1",
            "attention.output.dense",
            [
                "base_model.model.net.classifier.modules_to_save.default.bias",
                "base_model.model.net.classifier.modules_to_save.default.weight",
            ],
        ),
        (
            "vit",
            "base_model.model.net.vit.layers.1",
            "attention.o_proj",
            [
                "base_model.model.net.classifier.modules_to_save.default.bias",
                "base_model.model.net.classifier.modules_to_save.default.weight",
            ],
        ),
    ],
)
def test_same_layout_under_peft_lora(request, fixture, layer_name, o_suffix, trainable_outside):
    plain = find_architecture(request.getfixturevalue(fixture))
    model = with_lora(request.getfixturevalue(fixture), rank=2, alpha=4)
    arch = find_architecture(model)
    assert (arch.family, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        plain.family,
        plain.num_layers,
        plain.num_heads,
        plain.num_kv_heads,
        plain.head_dim,
    )
    assert arch.layers[1].name == layer_name
    assert arch.layers[1].o == f"{layer_name}.{o_suffix}"
    o = f"{layer_name}.{o_suffix}"
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    layer_trainable = [n for n in trainable if n.startswith(layer_name + ".")]
    # LoRA on exactly the four attention projections, the base weights frozen.
    assert len(layer_trainable) == 8
    assert (
        f"{o}.lora_A.default.weight" in layer_trainable
        and f"{o}.lora_B.default.weight" in layer_trainable
    )
    params = dict(model.named_parameters())
    assert not params[f"{o}.base_layer.weight"].requires_grad
    assert [n for n in trainable if arch.layer_of(n) is None] == trainable_outside


def test_unsupported_model_is_named():
    with pytest.raises(ValueError, match="no supported transformer layer list in Sequential"):
        find_architecture(nn.Sequential(nn.Linear(2, 2)))


def test_bare_bert_model_and_tabular_encoder():
    from transformers import BertConfig, BertModel

    from hydrafl.backbones import TinyShape
    from hydrafl.data import TaskSpec
    from hydrafl.models import build_model

    bare = BertModel(
        BertConfig(
            vocab_size=20,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=8,
        )
    )
    arch = find_architecture(
        bare
    )  # the layout of a pretrained encoder such as MiniLM (AutoModel -> BertModel)
    assert (arch.family, arch.layers_name, arch.num_heads, arch.head_dim) == (
        "bert",
        "encoder.layer",
        2,
        8,
    )
    assert arch.layers[1].o == "encoder.layer.1.attention.output.dense"
    task = TaskSpec(
        name="tab", modality="tabular", num_classes=2, class_names=("a", "b"), num_features=5
    )
    tab = build_model(task, shape=TinyShape(hidden=16, layers=2, heads=2, intermediate=32))
    assert find_architecture(tab).layers[0].q == "net.encoder.encoder.layer.0.attention.self.query"
