"""Importance scores against reference computations and a planted task."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hydrafl.backbones import with_lora
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.planning import select_heads
from hydrafl.subnet.scoring import eager_attention, head_importance, layer_importance
from hydrafl.subnet.spec import SubnetSpec

# ---- planted task: only one head carries the label ----------------------------------------------------------------


def test_planted_head_is_the_only_carrier_of_the_label(planted):
    model, x, y, star = planted
    swapped = x.clone()
    swapped[:, 1] = 5 - swapped[:, 1]  # A <-> B: flips the label-carrying token
    with torch.no_grad():
        assert (model(x).argmax(-1) == y).float().mean() == 1.0
        for head in range(4):
            keep = tuple(h for h in range(4) if h != head)
            with apply_spec(model, SubnetSpec(layers=(0,), heads=(keep,))):
                logits, logits_swapped = model(x), model(swapped)
            accuracy = float((logits.argmax(-1) == y).float().mean())
            if head == star:
                assert torch.equal(
                    logits, logits_swapped
                )  # without head 2 the output ignores the informative token
                assert accuracy <= 0.6
            else:
                assert accuracy == 1.0


def test_gate_gradient_ranks_the_planted_head_first(planted):
    model, x, y, star = planted
    scores = head_importance(model, [(x[:32], y[:32]), (x[32:], y[32:])])[0]
    ranked = sorted(range(4), key=lambda h: -scores[h])
    assert ranked[0] == star
    assert scores[star] > 1.5 * scores[ranked[1]]
    assert select_heads(scores, 1) == (star,)


def test_attention_confidence_of_the_planted_head(planted):
    model, x, y, star = planted
    scores = head_importance(model, [(x, y)], method="confidence")[0]
    # Planted head: the CLS query puts weight 1/(1 + 5 e^-32) ~ 1 on position 1, the 5 other queries are uniform
    # (max 1/6): mean max = (1 + 5/6) / 6. Other heads: q = k = 0, uniform everywhere: exactly 1/6.
    assert scores[star] == pytest.approx((1 + 5 / 6) / 6, abs=1e-6)
    for h in range(4):
        if h != star:
            assert scores[h] == pytest.approx(1 / 6, abs=1e-7)
    assert model.net.config._attn_implementation == "sdpa"  # eager only during scoring


def test_attention_confidence_on_causal_lora_llama(llama, lm_batch, lm_loss):
    model = with_lora(llama, rank=2, alpha=4)
    x, y = lm_batch
    scores = torch.tensor(head_importance(model, [(x, y)], lm_loss, method="confidence"))
    assert scores.shape == (3, 2)  # per layer, per KV group (mean of its 2 query heads)
    # causal attention: query t sees t + 1 keys, so its max weight is >= 1 / (t + 1); a non-causal run (the
    # known pitfall of custom attention functions) would be free to go below this bound
    bound = sum(1 / (t + 1) for t in range(8)) / 8
    assert bool((scores >= bound - 1e-6).all()) and bool((scores <= 1.0).all())
    assert llama.config._attn_implementation == "sdpa"
    # the eager weights the score reads are causal: exactly 0 above the diagonal, first query all on key 0
    seen = []
    hook = llama.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, out: seen.append(out[1])
    )
    with torch.no_grad(), eager_attention(model):
        model(input_ids=x)
    hook.remove()
    weights = seen[0]  # [batch, heads, queries, keys]
    assert weights.shape == (4, 4, 8, 8)
    assert torch.count_nonzero(torch.triu(weights, diagonal=1)) == 0
    assert torch.equal(weights[:, :, 0, 0], torch.ones(4, 4))


# ---- gate-gradient = Michel et al. E|A^T dL/dA|, per sample, also under GQA ---------------------------------------


def _michel_reference(model, arch, samples, loss_fn):
    """Per sample (one forward each): add a zero leaf z to o's input A (graph intact), dL/dz = dL/dA, and
    importance = |sum over the group's dims of A * dL/dA|."""
    total = torch.zeros(arch.num_layers, arch.num_groups, dtype=torch.float64)
    for x, y in samples:
        leaves, inputs = {}, {}

        def make(i, inputs=inputs, leaves=leaves):  # this sample's
            def hook(module, args):
                inputs[i] = args[0].detach()
                leaves[i] = torch.zeros_like(inputs[i], requires_grad=True)
                return (args[0] + leaves[i], *args[1:])

            return hook

        hooks = [
            model.get_submodule(ref.o).register_forward_pre_hook(make(ref.index))
            for ref in arch.layers
        ]
        loss = loss_fn(model, x, y)
        grads = torch.autograd.grad(loss, [leaves[i] for i in range(arch.num_layers)])
        for h in hooks:
            h.remove()
        for i, g in enumerate(grads):
            per_dim = (
                (inputs[i] * g).double().sum(dim=tuple(range(g.dim() - 1)))
            )  # [heads * head_dim]
            total[i] += per_dim.view(arch.num_groups, -1).sum(-1).abs()
    return total / len(samples)


def test_gate_gradient_equals_michel_reference_on_llama_gqa(llama, lm_batch, lm_loss):
    llama.eval()
    x, y = lm_batch
    arch = find_architecture(llama)
    reference = _michel_reference(
        llama, arch, [(x[i : i + 1], y[i : i + 1]) for i in range(len(x))], lm_loss
    )
    scores = torch.tensor(head_importance(llama, [(x, y)], lm_loss), dtype=torch.float64)
    assert scores.shape == (3, 2)  # per layer, per KV group
    assert torch.allclose(scores, reference, rtol=1e-5, atol=1e-9)
    assert all(p.grad is None for p in llama.parameters())


def test_head_scores_do_not_depend_on_batching(bert, text_batch):
    x, y = text_batch
    one = torch.tensor(head_importance(bert, [(x, y)]))
    three = torch.tensor(
        head_importance(bert, [(x[i : i + 2], y[i : i + 2]) for i in range(0, 6, 2)])
    )
    assert torch.allclose(one, three, rtol=1e-5, atol=1e-10)
    capped = torch.tensor(head_importance(bert, [(x, y)], max_samples=2))
    assert torch.allclose(
        capped, torch.tensor(head_importance(bert, [(x[:2], y[:2])])), rtol=0, atol=0
    )


# ---- layer scores --------------------------------------------------------------------------------------------------


def test_fisher_matches_per_sample_backward_reference(bert, text_batch):
    bert.eval()
    x, y = text_batch
    scores = layer_importance(bert, [(x[:4], y[:4]), (x[4:], y[4:])], method="fisher")
    arch = find_architecture(bert)
    reference = [0.0] * 3
    for i in range(len(y)):
        bert.zero_grad()
        F.cross_entropy(bert(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in bert.named_parameters():
            layer = arch.layer_of(name)
            if layer is not None:
                reference[layer] += float(p.grad.double().pow(2).sum()) / len(y)
    bert.zero_grad(set_to_none=True)
    assert scores == pytest.approx(reference, rel=1e-6)


def test_taylor_matches_full_batch_reference_and_is_zero_for_an_identity_layer(
    llama, lm_batch, lm_loss
):
    with torch.no_grad():  # layer 1 becomes an exact identity: residual only
        llama.model.layers[1].self_attn.o_proj.weight.zero_()
        llama.model.layers[1].mlp.down_proj.weight.zero_()
    x, y = lm_batch
    scores = layer_importance(llama, [(x, y)], lm_loss, method="taylor")
    arch = find_architecture(llama)
    llama.eval()
    lm_loss(llama, x, y).backward()
    sums = [0.0] * 3
    for name, p in llama.named_parameters():
        layer = arch.layer_of(name)
        if layer is not None:
            sums[layer] += float((p.grad.double() * p.detach().double()).sum())
    assert scores == pytest.approx([abs(s) for s in sums], rel=1e-6)
    assert scores[1] == 0.0  # no gradient reaches q/k/v/gate/up, and o/down are zero: exactly 0
    assert scores[0] > 0 and scores[2] > 0
    # batching only changes float rounding of the mean gradient
    split = layer_importance(llama, [(x[:2], y[:2]), (x[2:], y[2:])], lm_loss, method="taylor")
    assert split == pytest.approx(scores, rel=1e-4)


def test_lora_trainable_only_taylor_is_zero_at_init_hence_default_over_all(
    llama, lm_batch, lm_loss
):
    model = with_lora(llama, rank=2, alpha=4)  # PEFT default: B = 0
    x, y = lm_batch
    assert layer_importance(model, [(x, y)], lm_loss, method="taylor", over="trainable") == [
        0.0,
        0.0,
        0.0,
    ]
    assert all(s > 0 for s in layer_importance(model, [(x, y)], lm_loss, method="taylor"))
    # scoring leaves requires_grad, .grad and train mode as they were
    model.train()
    layer_importance(model, [(x, y)], lm_loss, method="fisher", max_samples=2)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert sum(p.requires_grad for p in model.parameters()) == 3 * 8  # only the LoRA factors
