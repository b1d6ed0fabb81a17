"""Hand-counted parameter, byte and FLOP numbers of models and subnetworks."""

from __future__ import annotations

from transformers import ViTConfig, ViTForImageClassification

from hydrafl.backbones import with_lora
from hydrafl.subnet.counts import forward_flops, parameter_bytes, parameter_count
from hydrafl.subnet.spec import SubnetSpec

# Tiny Llama of conftest.LLAMA: hidden 32, 3 layers, 4 heads / 2 KV heads of 8, intermediate 48, vocab 40.
# Per layer: q 32x32 (1024) + k 16x32 (512) + v 512 + o 1024 + gate/up/down 3 x 48x32 (4608) = 7680 matmul weights,
# + 2 RMSNorm x 32. LM head 40x32 = 1280, embeddings 40x32 = 1280, final norm 32.
LAYER_MATMUL = 7680
ATTN_PROJ = 3072  # q + k + v + o


def test_parameter_counts(llama):
    assert parameter_count(llama) == 1280 + 3 * (LAYER_MATMUL + 64) + 32 + 1280 == 25824
    assert parameter_bytes(llama) == 4 * 25824
    lora = with_lora(llama, rank=2, alpha=4)
    # per layer: q A 2x32 + B 32x2, k A 2x32 + B 16x2, v the same, o A 2x32 + B 32x2 = 128 + 96 + 96 + 128 = 448
    assert parameter_count(lora) == 3 * 448
    assert parameter_count(lora, trainable_only=False) == 25824 + 3 * 448


def test_forward_flops_hand_count(llama):
    S = 8
    attention_per_layer = 4 * S * S * 4 * 8  # QK^T and AV: 4 S^2 x heads x head_dim = 8192
    full = 2 * S * (3 * LAYER_MATMUL + 1280) + 3 * attention_per_layer
    assert full == 413696
    assert forward_flops(llama, S) == full
    # bypassing layer 1 removes its matmuls and attention
    bypass = SubnetSpec(layers=(0, 2), bypass=True)
    assert (
        forward_flops(llama, S, bypass)
        == 2 * S * (2 * LAYER_MATMUL + 1280) + 2 * attention_per_layer
        == 282624
    )
    # freezing does not save forward compute
    assert forward_flops(llama, S, SubnetSpec(layers=(0, 2))) == full
    # one of two KV groups in layers 0 and 2: the pruned subnetwork computes half of q/k/v/o and half the heads
    heads = SubnetSpec(layers=(0, 1, 2), heads=((0,), (0, 1), (1,)))
    pruned = (
        2 * S * (3 * LAYER_MATMUL - 2 * ATTN_PROJ // 2 + 1280)
        + 2 * attention_per_layer // 2
        + attention_per_layer
    )
    assert forward_flops(llama, S, heads, executed=False) == pruned == 356352
    assert (
        forward_flops(llama, S, heads, executed=True) == full
    )  # the mask hook still runs every head
    # width 0.5: 4 of each head's 8 dims (q/k/v rows, o columns, QK^T and AV) and 24 of the 48 FFN units
    width = SubnetSpec(layers=(0, 1, 2), width_ratio=0.5)
    assert (
        forward_flops(llama, S, width, executed=False)
        == 2 * S * (3 * LAYER_MATMUL // 2 + 1280) + 3 * attention_per_layer // 2
    )
    assert (
        forward_flops(llama, S, width, executed=True) == full
    )  # masking still computes every channel
    # width 0.3: ceil(2.4) = 3 of 8 head dims, ceil(14.4) = 15 of 48 FFN units, wherever the window starts
    rolled = SubnetSpec(layers=(0, 1, 2), width_ratio=0.3, width_offset=6)
    matmul = ATTN_PROJ * 3 / 8 + (LAYER_MATMUL - ATTN_PROJ) * 15 / 48
    assert (
        forward_flops(llama, S, rolled, executed=False)
        == round(2 * S * (3 * matmul + 1280)) + 3 * 4 * S * S * 4 * 3
    )
    # LoRA adds its factors' matmuls (448 per layer), the base weights still run
    assert forward_flops(with_lora(llama, rank=2, alpha=4), S) == full + 2 * S * 3 * 448 == 435200


def test_bert_flops_count_the_pooled_head_per_token(bert):
    # hidden 32, 3 layers, 4 heads of 8, intermediate 48; q/k/v/o 4 x 1024 + FFN 2 x 1536 = 7168 per layer;
    # outside: pooler 1024 + classifier 96, counted per token (an upper bound for the pooled head)
    S = 8
    assert forward_flops(bert, S) == 2 * S * (3 * 7168 + 1024 + 96) + 3 * 4 * S * S * 32 == 386560


def test_forward_flops_of_a_vit_by_hand():
    """ViT, hidden 16, 2 layers of 2 heads, FFN 32, 8x8 RGB images in 4x4 patches: 4 patches + CLS = 5 tokens."""
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    vit = ViTForImageClassification(config)
    S, layer = 5, 4 * 16 * 16 + 2 * 16 * 32  # q/k/v/o 1024 + FFN 1024 per layer
    outside = 16 * 3 * 4 * 4 + 16 * 3  # patch projection (a conv) and classifier, counted per token
    attention = 4 * S * S * 2 * 8  # QK^T and AV per layer
    assert forward_flops(vit, S) == 2 * S * (2 * layer + outside) + 2 * attention == 52320
    one_head = SubnetSpec(
        layers=(0, 1), heads=((0,), (1,))
    )  # half of q/k/v/o and of the attention per layer
    assert (
        forward_flops(vit, S, one_head, executed=False)
        == 2 * S * (2 * (layer - 512) + outside) + attention
    )
