"""Trained slices: exact index sets, hand-counted bytes, exact extract/merge round trips, and that a site's
local update lies entirely inside its slices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hydrafl.arrays import record_nbytes, to_record
from hydrafl.backbones import with_lora
from hydrafl.subnet.apply import apply_spec, trainable_slices
from hydrafl.subnet.counts import parameter_bytes, parameter_count
from hydrafl.subnet.slices import Slice, coordinate_masks, extract, merge, payload_bytes
from hydrafl.subnet.spec import SubnetSpec

L1 = "base_model.model.model.layers.1.self_attn"


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_llama_lora_slices_are_the_kept_groups_rows_and_columns(llama):
    model = with_lora(llama, rank=2, alpha=4)
    spec = SubnetSpec(
        layers=(1,), heads=((0,),)
    )  # KV group 0 = query heads 0, 1 = q/o dims 0..15, k/v dims 0..7
    slices = trainable_slices(model, spec)
    assert slices == {
        f"{L1}.q_proj.lora_A.default.weight": Slice(None),
        f"{L1}.q_proj.lora_B.default.weight": Slice(0, tuple(range(16))),
        f"{L1}.k_proj.lora_A.default.weight": Slice(None),
        f"{L1}.k_proj.lora_B.default.weight": Slice(0, tuple(range(8))),
        f"{L1}.v_proj.lora_A.default.weight": Slice(None),
        f"{L1}.v_proj.lora_B.default.weight": Slice(0, tuple(range(8))),
        f"{L1}.o_proj.lora_A.default.weight": Slice(1, tuple(range(16))),
        f"{L1}.o_proj.lora_B.default.weight": Slice(None),
    }
    # hand count (rank 2, hidden 32): q A 2x32 + q B 16x2 + k A 2x32 + k B 8x2 + v A 2x32 + v B 8x2
    #                                 + o A 2x16 + o B 32x2 = 64+32+64+16+64+16+32+64 = 352 floats
    extracted = extract(_state(model), slices)
    assert payload_bytes(extracted) == 352 * 4 == 1408
    record = to_record(
        extracted
    )  # what actually travels: the same data bytes, plus an .npy header per tensor
    assert sum(array.numpy().nbytes for array in record.values()) == 1408
    assert 0 < record_nbytes(record) - 1408 <= 128 * len(record)
    assert parameter_count(model, spec) == 352 and parameter_bytes(model, spec) == 1408
    assert extracted[f"{L1}.q_proj.lora_B.default.weight"].shape == (16, 2)
    assert extracted[f"{L1}.o_proj.lora_A.default.weight"].shape == (2, 16)
    masks = coordinate_masks(slices, _state(model))
    assert sum(int(m.sum()) for m in masks.values()) == 352
    assert masks[f"{L1}.o_proj.lora_A.default.weight"][:, :16].all()
    assert not masks[f"{L1}.o_proj.lora_A.default.weight"][:, 16:].any()


def test_full_bert_hand_count(bert):
    spec = SubnetSpec(layers=(2,), heads=((1, 2),))  # heads 1, 2 = dims 8..23
    # layer 2: q/k/v weight rows 16x32 each (1536) + bias rows 16 each (48), o weight columns 32x16 (512)
    # + o bias 32, attention LayerNorm 64, FFN 48x32+48 + 32x48+32 (3200), output LayerNorm 64 -> 5408
    # outside: embeddings 40x32 + 8x32 + 2x32 + 64 (1664), pooler 32x32+32 (1056), classifier 3x32+3 (99) -> 2819
    assert parameter_count(bert, spec) == 5408 + 2819
    assert parameter_bytes(bert, spec) == 4 * (5408 + 2819)
    inside = SubnetSpec(layers=(2,), heads=((1, 2),), train_outside=False)
    assert payload_bytes(extract(_state(bert), trainable_slices(bert, inside))) == 4 * 5408
    slices = trainable_slices(bert, spec)
    b = "net.bert.encoder.layer.2.attention"
    assert slices[f"{b}.self.key.bias"] == Slice(0, tuple(range(8, 24)))
    assert slices[f"{b}.output.dense.weight"] == Slice(1, tuple(range(8, 24)))
    assert slices[f"{b}.output.dense.bias"] == Slice(None)
    assert not any(".layer.0." in n or ".layer.1." in n for n in slices)
    # all heads kept: whole tensors, and the full model is the sum of everything
    assert parameter_count(bert, SubnetSpec.full(3)) == parameter_count(bert)


def test_extract_merge_round_trip_is_exact(llama):
    model = with_lora(llama, rank=2, alpha=4, init_lora_weights=False)
    spec = SubnetSpec(layers=(0, 2), heads=((1,), (0,)))
    slices = trainable_slices(model, spec)
    state = _state(model)
    extracted = extract(state, slices)
    # into a different base: sliced coordinates come from `state`, every other coordinate stays the base's
    base = {n: torch.full_like(t, 7.0) for n, t in state.items()}
    merged = merge(base, slices, extracted)
    masks = coordinate_masks(slices, state)
    for name, t in merged.items():
        if name in slices:
            assert torch.equal(t[masks[name]], state[name][masks[name]])
            assert torch.all(t[~masks[name]] == 7.0)
        else:
            assert t is base[name]
    # into the state itself: identity, bit for bit; and the base is not modified
    assert all(torch.equal(merge(state, slices, extracted)[n], state[n]) for n in state)
    assert all(torch.all(t == 7.0) for t in base.values())


def test_local_training_changes_only_the_sliced_coordinates(llama, lm_batch, lm_loss):
    """A site trains its Hydra-net (Adam, no weight decay); the update is captured exactly by its slices."""
    spec = SubnetSpec(layers=(0, 2), heads=((1,), (0,)))
    slices = trainable_slices(llama, spec)
    start = _state(llama)
    x, y = lm_batch
    with apply_spec(llama, spec):
        opt = torch.optim.Adam([p for p in llama.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            lm_loss(llama, x, y).backward()
            opt.step()
    end = _state(llama)
    rebuilt = merge(start, slices, extract(end, slices))
    assert all(torch.equal(rebuilt[n], end[n]) for n in end)
    masks = coordinate_masks(slices, start)
    changed = sum(int((end[n] != start[n]).sum()) for n in end)
    assert changed == sum(int((end[n] != start[n])[masks[n]].sum()) for n in slices)
    assert changed > 0.9 * sum(int(m.sum()) for m in masks.values())


def test_gradient_support_equals_the_slices_under_lora(bert, text_batch):
    model = with_lora(bert, rank=2, alpha=4, init_lora_weights=False)
    spec = SubnetSpec(layers=(1,), heads=((0, 3),))
    slices = trainable_slices(model, spec)
    x, y = text_batch
    with apply_spec(model, spec):
        F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        if name not in slices:
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, name
            continue
        mask = slices[name].mask(p.shape)
        assert torch.count_nonzero(p.grad[~mask]) == 0, name
        assert torch.count_nonzero(p.grad[mask]) == int(mask.sum()), (
            name
        )  # every sliced coordinate is trained
    assert "base_model.model.net.classifier.modules_to_save.default.weight" in slices


def test_errors_name_the_tensor(llama):
    slices = {"model.layers.0.self_attn.q_proj.weight": Slice(0, (0, 1))}
    with pytest.raises(KeyError, match="state lacks 1 sliced tensors"):
        extract({}, slices)
    state = _state(llama)
    with pytest.raises(ValueError, match=r"slice values have shape \(3, 32\), expected \(2, 32\)"):
        merge(state, slices, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 32)})
    with pytest.raises(KeyError, match="extracted payload lacks"):
        merge(state, slices, {})
