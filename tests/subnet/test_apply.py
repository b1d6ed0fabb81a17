"""Head masking and layer freezing/bypass on live models, against independent reference computations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hydrafl.backbones import with_lora
from hydrafl.subnet.apply import apply_spec, trainable_slices
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.slices import Slice, read_slices
from hydrafl.subnet.spec import SubnetSpec


def _bert_reference(net, x: torch.Tensor, kept: dict[int, tuple[int, ...]]) -> torch.Tensor:
    """BERT classifier logits written out by hand: per-head attention, dropped heads' context set to zero."""
    bert = net.bert
    h = bert.embeddings(input_ids=x)
    pad = x == 0  # [B, S] keys to ignore
    for i, layer in enumerate(bert.encoder.layer):
        att, out = layer.attention.self, layer.attention.output
        heads, d = att.num_attention_heads, att.attention_head_size
        B, S, _ = h.shape

        q, k, v = (
            t.view(B, S, heads, d).transpose(1, 2)  # [B, heads, S, d]
            for t in (att.query(h), att.key(h), att.value(h))
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        context = torch.softmax(scores, dim=-1) @ v  # [B, heads, S, d]
        for head in range(heads):
            if i in kept and head not in kept[i]:
                context[:, head] = 0.0
        context = context.transpose(1, 2).reshape(B, S, heads * d)
        a = out.LayerNorm(F.linear(context, out.dense.weight, out.dense.bias) + h)
        ffn = F.linear(
            F.gelu(layer.intermediate.dense(a)), layer.output.dense.weight, layer.output.dense.bias
        )
        h = layer.output.LayerNorm(ffn + a)
    pooled = torch.tanh(bert.pooler.dense(h[:, 0]))
    return net.classifier(pooled)


def test_bert_head_mask_equals_hand_written_reference(bert, text_batch):
    model = bert.double().eval()
    x, _ = text_batch
    x = x.clone()
    x[0, 6:] = 0  # padding, to exercise the attention mask too
    x[3, 5:] = 0
    kept = {0: (1, 3), 1: (0,)}  # layer 2: all heads
    spec = SubnetSpec(layers=(0, 1, 2), heads=(kept[0], kept[1], (0, 1, 2, 3)))
    with torch.no_grad():
        full = model(x)
        assert torch.allclose(full, _bert_reference(model.net, x, {}), atol=1e-10, rtol=0)
        with apply_spec(model, spec):
            masked = model(x)
        reference = _bert_reference(model.net, x, kept)
        after = model(x)
    assert torch.allclose(masked, reference, atol=1e-10, rtol=0)
    assert (
        masked - full
    ).abs().max() > 1e-5  # the mask really changes the function (100000x the tolerance)
    assert torch.equal(after, full)  # remove() restores the model exactly


def _zero_o_inputs(model, arch, layer: int, dims: list[int]) -> None:
    """Reference masking: zero the columns of o (base weight and LoRA A) that read the dropped heads."""
    o = model.get_submodule(arch.layers[layer].o)
    with torch.no_grad():
        if hasattr(o, "base_layer"):
            o.base_layer.weight[:, dims] = 0.0
            for a in o.lora_A.values():
                a.weight[:, dims] = 0.0
        else:
            o.weight[:, dims] = 0.0


@pytest.mark.parametrize("lora", [False, True])
def test_llama_gqa_group_mask_equals_zeroed_o_columns(llama, lm_batch, lora):
    model = with_lora(llama, rank=2, alpha=4, init_lora_weights=False) if lora else llama
    model.eval()
    arch = find_architecture(model)
    x, _ = lm_batch
    # Layer 1 keeps KV group 1 = query heads 2, 3 (o input dims 16..31); layer 2 keeps group 0 (dims 0..15).
    spec = SubnetSpec(layers=(1, 2), heads=((1,), (0,)))
    with torch.no_grad():
        with apply_spec(model, spec):
            masked = model(input_ids=x).logits
        reference_model = copy.deepcopy(model)
        _zero_o_inputs(reference_model, arch, 1, list(range(16)))
        _zero_o_inputs(reference_model, arch, 2, list(range(16, 32)))
        reference = reference_model(input_ids=x).logits
        full = model(input_ids=x).logits
    assert torch.allclose(masked, reference, atol=1e-6, rtol=0)
    assert (masked - full).abs().max() > 1e-3


def test_vit_head_mask_equals_zeroed_o_columns(vit, image_batch):
    model = vit.eval()
    arch = find_architecture(model)
    x, _ = image_batch
    spec = SubnetSpec(layers=(0,), heads=((2,),))
    with torch.no_grad():
        with apply_spec(model, spec):
            masked = model(x)
        reference_model = copy.deepcopy(model)
        _zero_o_inputs(reference_model, arch, 0, list(range(16)) + list(range(24, 32)))
        reference = reference_model(x)
        full = model(x)
    assert torch.allclose(masked, reference, atol=1e-6, rtol=0)
    assert (masked - full).abs().max() > 1e-4


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def test_masked_heads_get_exactly_zero_gradient_llama_full(llama, lm_batch, lm_loss):
    x, y = lm_batch
    spec = SubnetSpec(layers=(0, 2), heads=((1,), (0,)))
    with apply_spec(llama, spec):
        lm_loss(llama, x, y).backward()
        g = _grads(llama)
    L0, L2 = "model.layers.0.self_attn", "model.layers.2.self_attn"
    # layer 0 keeps group 1: q rows 16..31, k/v rows 8..15, o columns 16..31
    assert torch.count_nonzero(g[f"{L0}.q_proj.weight"][:16]) == 0
    assert torch.count_nonzero(g[f"{L0}.q_proj.weight"][16:]) == 16 * 32
    for kv in ("k_proj", "v_proj"):
        assert torch.count_nonzero(g[f"{L0}.{kv}.weight"][:8]) == 0
        assert torch.count_nonzero(g[f"{L0}.{kv}.weight"][8:]) == 8 * 32
    assert torch.count_nonzero(g[f"{L0}.o_proj.weight"][:, :16]) == 0
    assert torch.count_nonzero(g[f"{L0}.o_proj.weight"][:, 16:]) == 32 * 16
    # layer 2 keeps group 0
    assert torch.count_nonzero(g[f"{L2}.q_proj.weight"][16:]) == 0
    assert torch.count_nonzero(g[f"{L2}.o_proj.weight"][:, 16:]) == 0
    # layer 1 is frozen: no gradient at all; FFN of selected layers trains fully
    assert all(v is None for n, v in g.items() if n.startswith("model.layers.1."))
    assert torch.count_nonzero(g["model.layers.0.mlp.down_proj.weight"]) == 32 * 48
    # after remove(): every parameter trainable again, no hooks left
    assert all(p.requires_grad for p in llama.parameters())
    assert not any(hasattr(p, "_hydrafl_frozen") for p in llama.parameters())
    assert all(not m._forward_pre_hooks for m in llama.modules())


def test_masked_heads_get_exactly_zero_gradient_under_lora(llama, lm_batch, lm_loss):
    model = with_lora(
        llama, rank=2, alpha=4, init_lora_weights=False
    )  # B random, so every factor gets gradient
    x, y = lm_batch
    spec = SubnetSpec(layers=(1,), heads=((0,),))  # group 0: query heads 0, 1
    with apply_spec(model, spec):
        lm_loss(model, x, y).backward()
    g = _grads(model)
    L = "base_model.model.model.layers.1.self_attn"
    assert torch.count_nonzero(g[f"{L}.q_proj.lora_B.default.weight"][16:]) == 0
    assert torch.count_nonzero(g[f"{L}.q_proj.lora_B.default.weight"][:16]) == 16 * 2
    for kv in ("k_proj", "v_proj"):
        assert torch.count_nonzero(g[f"{L}.{kv}.lora_B.default.weight"][8:]) == 0
        assert torch.count_nonzero(g[f"{L}.{kv}.lora_B.default.weight"][:8]) == 8 * 2
    # o's LoRA A reads the concatenated heads: masked heads' columns get zero gradient
    assert torch.count_nonzero(g[f"{L}.o_proj.lora_A.default.weight"][:, 16:]) == 0
    assert torch.count_nonzero(g[f"{L}.o_proj.lora_A.default.weight"][:, :16]) == 2 * 16
    assert g[f"{L}.o_proj.base_layer.weight"] is None  # frozen by LoRA
    assert all(v is None for n, v in g.items() if ".layers.0." in n or ".layers.2." in n)


def test_bert_bias_rows_of_masked_heads_get_zero_gradient(bert, text_batch):
    x, y = text_batch
    with apply_spec(bert, SubnetSpec(layers=(2,), heads=((1, 2),))):
        F.cross_entropy(bert(x), y).backward()
    s = "net.bert.encoder.layer.2.attention.self"
    grads = dict(bert.named_parameters())
    for proj in (
        "query",
        "value",
    ):  # (the key bias has no effect on softmax: its gradient is ~0 for all heads)
        b = grads[f"{s}.{proj}.bias"].grad
        assert torch.count_nonzero(b[:8]) == 0 and torch.count_nonzero(b[24:]) == 0
        assert torch.count_nonzero(b[8:24]) == 16


def test_frozen_layers_keep_the_function_bypassed_layers_skip_it(llama, lm_batch):
    llama.eval()
    x, _ = lm_batch
    calls = []
    llama.model.layers[1].self_attn.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        full = llama(input_ids=x).logits
        with apply_spec(llama, SubnetSpec(layers=(0, 2))):
            frozen = llama(input_ids=x).logits
        assert torch.equal(frozen, full) and len(calls) == 2  # a frozen layer still runs
        with apply_spec(llama, SubnetSpec(layers=(0, 2), bypass=True)):
            bypassed = llama(input_ids=x).logits
        assert len(calls) == 2  # a bypassed layer does not
        reference = copy.deepcopy(llama)
        reference.model.layers = nn.ModuleList(
            [reference.model.layers[0], reference.model.layers[2]]
        )
        expected = reference(input_ids=x).logits
        after = llama(input_ids=x).logits
    assert torch.allclose(bypassed, expected, atol=1e-6, rtol=0)
    assert (bypassed - full).abs().max() > 1e-3
    assert torch.equal(after, full) and len(calls) == 3
    assert "forward" not in vars(llama.model.layers[1])


def test_bert_bypass_equals_the_model_without_the_layer(bert, text_batch):
    bert.eval()
    x, _ = text_batch
    with torch.no_grad():
        with apply_spec(bert, SubnetSpec(layers=(1,), bypass=True)):
            bypassed = bert(x)
        reference = copy.deepcopy(bert)
        reference.net.bert.encoder.layer = nn.ModuleList([reference.net.bert.encoder.layer[1]])
        expected = reference(x)
    assert torch.allclose(bypassed, expected, atol=1e-6, rtol=0)


def test_width_ratio_is_applied_not_ignored(llama):
    from hydrafl.subnet.spec import SpecError

    with apply_spec(llama, SubnetSpec(layers=(0,), width_ratio=0.5)) as handle:
        assert (
            handle.width_ratio == 0.5
        )  # masking per width: tests/strategies/test_width_baselines.py
    assert all(p.requires_grad for p in llama.parameters())
    with pytest.raises(SpecError, match="selects heads or a width"):
        SubnetSpec(layers=(0,), heads=((0,),), width_ratio=0.5)


@pytest.mark.parametrize("lora", [False, True])
def test_frozen_heads_keep_the_function_and_train_only_the_kept_heads_coordinates(
    llama, lm_batch, lm_loss, lora
):
    """freeze_heads: the forward pass is the whole model's, the gradient is the whole model's on the kept heads'
    coordinates and exactly zero on the dropped heads' (the same coordinates masking zeroes)."""
    model = with_lora(llama, rank=2, alpha=4, init_lora_weights=False) if lora else llama
    x, y = lm_batch
    whole = lm_loss(model, x, y)
    whole.backward()
    reference = {n: g.clone() for n, g in _grads(model).items() if g is not None}
    model.zero_grad()
    spec = SubnetSpec(layers=(1,), heads=((0,),), freeze_heads=True)  # group 0: query heads 0, 1
    with apply_spec(model, spec) as handle:
        frozen = lm_loss(model, x, y)
        frozen.backward()
        slices = trainable_slices(model, spec)
        assert handle._hooks  # one gradient hook per tensor a dropped head owns part of
    assert torch.equal(frozen, whole)
    grads = _grads(model)
    for name, sl in slices.items():
        mask = sl.mask(grads[name].shape)
        assert torch.count_nonzero(grads[name][~mask]) == 0, name
        torch.testing.assert_close(grads[name][mask], reference[name][mask], rtol=0, atol=0)
    prefix = "base_model.model.model" if lora else "model"
    q_name = f"{prefix}.layers.1.self_attn.q_proj.{'lora_B.default.' if lora else ''}weight"
    assert slices[q_name].dim == 0 and torch.count_nonzero(grads[q_name][16:]) == 0
    assert torch.count_nonzero(reference[q_name][16:]) > 0  # the whole model does train them
    assert not any(p._backward_hooks for p in model.parameters())  # remove() took the hooks off


def test_frozen_heads_are_read_whole_and_round_trip_through_the_config():
    spec = SubnetSpec(layers=(1,), heads=((0,),), freeze_heads=True)
    assert SubnetSpec.from_config(spec.to_config()) == spec
    dropped = SubnetSpec(layers=(1,), heads=((0,),))
    assert (
        SubnetSpec.from_config({k: v for k, v in dropped.to_config().items() if "freeze" not in k})
        == dropped
    )
    trained = {"q": Slice(0, (0, 1)), "ffn": Slice(None)}
    layers = {"q": 1, "ffn": 1, "k0": 0}
    assert read_slices(trained, layers, spec) == {
        "q": Slice(None),
        "ffn": Slice(None),
        "k0": Slice(None),
    }
    assert read_slices(trained, layers, dropped) == {
        "q": Slice(0, (0, 1)),
        "ffn": Slice(None),
        "k0": Slice(None),
    }
