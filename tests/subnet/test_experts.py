"""Expert selection on a live mixture-of-experts LM (Mixtral family): what a site trains, and what it leaves be."""

from __future__ import annotations

import pytest
import torch

from hydrafl import protocol
from hydrafl.backbones import TinyShape, build_moe_lm
from hydrafl.client.model_probes import slice_layout
from hydrafl.subnet.apply import apply_spec, trainable_slices
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.slices import Slice, layout_slices, read_slices
from hydrafl.subnet.spec import SpecError, SubnetSpec

SHAPE = TinyShape(hidden=16, layers=2, heads=2, intermediate=8, experts=4, experts_per_token=2)
EXPERT_TENSORS = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture
def moe() -> torch.nn.Module:
    return build_moe_lm(32, shape=SHAPE, seed=0).eval()


def _batch() -> torch.Tensor:
    return torch.randint(3, 32, (3, 7), generator=torch.Generator().manual_seed(1))


def test_architecture_counts_the_experts(moe):
    assert find_architecture(moe).num_experts == 4


def test_untrained_experts_get_exactly_zero_gradient_and_the_forward_is_unchanged(moe):
    x = _batch()
    with torch.no_grad():
        before = moe(input_ids=x).logits
    spec = SubnetSpec(layers=(0, 1), experts=((1, 3), (0,)))
    with apply_spec(moe, spec):
        logits = moe(input_ids=x).logits
        assert torch.equal(
            logits, before
        )  # every expert still runs: the function is the global model's
        logits.square().mean().backward()
    params = dict(moe.named_parameters())
    for layer, kept in ((0, (1, 3)), (1, (0,))):
        for path in EXPERT_TENSORS:
            grad = params[f"model.layers.{layer}.{path}"].grad
            for expert in range(4):
                if expert in kept:
                    assert grad[expert].abs().sum() > 0, (layer, path, expert)
                else:
                    assert torch.equal(grad[expert], torch.zeros_like(grad[expert]))
    # everything else of the selected layers trains as before
    assert params["model.layers.0.self_attn.q_proj.weight"].grad.abs().sum() > 0


def test_trained_experts_compute_what_they_computed_before(moe):
    """A kept expert's output on the tokens routed to it is the same with the spec applied (hooked on the
    stacked experts' forward, which receives each token's top-k indices and weights)."""
    x = _batch()
    seen: list[torch.Tensor] = []
    experts = moe.get_submodule("model.layers.0.mlp.experts")
    hook = experts.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            moe(input_ids=x)
            with apply_spec(moe, SubnetSpec(layers=(0, 1), experts=((2,), (1, 2)))):
                moe(input_ids=x)
    finally:
        hook.remove()
    assert torch.equal(seen[0], seen[1])


def test_slices_of_a_spec_are_the_trained_experts_rows_and_experts_are_read_whole(moe):
    spec = SubnetSpec(layers=(0, 1), experts=((1, 3), (0, 1, 2, 3)), freeze_heads=False)
    slices = trainable_slices(moe, spec)
    for path in EXPERT_TENSORS:
        assert slices[f"model.layers.0.{path}"] == Slice(0, (1, 3))
        assert slices[f"model.layers.1.{path}"] == Slice(0, (0, 1, 2, 3))
    assert slices["model.layers.0.self_attn.o_proj.weight"] == Slice(None)
    layout = slice_layout(moe)
    by_name = dict(
        zip(
            layout[protocol.LAYOUT_NAMES],
            zip(
                layout[protocol.LAYOUT_LAYERS],
                layout[protocol.LAYOUT_AXES],
                layout[protocol.LAYOUT_UNITS],
                strict=True,
            ),
            strict=True,
        )
    )
    assert layout_slices(by_name, spec) == slices  # the coordinator slices the same coordinates
    layers = {name: layer for name, (layer, _, _) in by_name.items()}
    assert all(sl == Slice(None) for sl in read_slices(slices, layers, spec).values())


def test_expert_selection_round_trips_and_is_checked(moe):
    spec = SubnetSpec(layers=(1, 0), experts=((3, 0), (2,)))
    assert spec.experts == ((2,), (0, 3))  # sorted with the layers
    assert SubnetSpec.from_config(spec.to_config()) == spec
    assert SubnetSpec.from_config(SubnetSpec(layers=(0,)).to_config()).experts is None
    with pytest.raises(SpecError, match="expert 4 of layer 0 out of range"):
        SubnetSpec(layers=(0,), experts=((4,),)).check(find_architecture(moe))
    with pytest.raises(SpecError, match="keeps no experts"):
        SubnetSpec(layers=(0,), experts=((),))


def test_tiny_moe_and_a_local_mixtral_checkpoint_build_the_same_model(tmp_path):
    """`--model tiny-moe` for the next-token task; its checkpoint directory loads through `from_pretrained`
    into the same function, with its experts found."""
    from hydrafl.data import load_cohort
    from hydrafl.models import build_model

    task = load_cohort("clinical-notes-lm", num_sites=1, seed=0, samples_per_site=8).task
    model = build_model(task, model="tiny-moe", seed=3)
    model.net.save_pretrained(tmp_path)
    loaded = build_model(task, model=str(tmp_path))
    x = torch.randint(3, task.vocab_size, (2, 9))
    assert torch.equal(model(x), loaded(x))
    arch = find_architecture(loaded)
    assert (arch.num_experts, arch.num_layers) == (8, 2)
    with pytest.raises(ValueError, match="use 'tiny', 'tiny-moe' or a local"):
        build_model(task, model="moe")


def test_a_private_run_scores_experts_by_router_rows_and_reads_no_data(moe):
    from hydrafl.client.model_probes import expert_scores

    router = moe.get_submodule("model.layers.1.mlp.gate")
    with torch.no_grad():
        router.weight.copy_(
            torch.arange(4.0)[:, None].expand(4, 16)
        )  # row e: 16 entries equal to e
    scores = expert_scores(moe, [], private=True)  # no batches: nothing of the site's data is read
    assert [scores[f"{protocol.EXPERT_PREFIX}1-{e}"] for e in range(4)] == [0.0, 16.0, 64.0, 144.0]
    assert not any(key.startswith(protocol.COACTIVATION_PREFIX) for key in scores)
    routed = expert_scores(moe, [(_batch(), _batch())], private=False)
    assert sum(routed[f"{protocol.EXPERT_PREFIX}0-{e}"] for e in range(4)) == pytest.approx(2.0)
    assert f"{protocol.COACTIVATION_PREFIX}0-0-3" in routed
