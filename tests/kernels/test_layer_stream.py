"""Layer streaming: the streamed round sends the in-memory round's delta, holds at most a window of blocks, and
trains a model whose parameter memory exceeds the site's budget in memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch import nn

from hydrafl.data import load_cohort
from hydrafl.kernels.distributed import DistributedResult, train_distributed
from hydrafl.kernels.layer_store import MemoryBudgetError, parameter_footprint
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.losses import LossFn, classification_loss, next_token_loss
from hydrafl.models import LoraSpec, TinyShape, build_model, federated_state
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.spec import SubnetSpec

SHAPE = TinyShape(hidden=32, layers=4, heads=4, intermediate=64)


@pytest.fixture(scope="module")
def text() -> tuple[object, torch.Tensor, torch.Tensor]:
    cohort = load_cohort("clinical-text", num_sites=1, samples_per_site=48)
    return cohort.task, cohort.sites[0].train_x, cohort.sites[0].train_y


@pytest.fixture(scope="module")
def notes() -> tuple[object, torch.Tensor, torch.Tensor]:
    cohort = load_cohort("clinical-notes-lm", num_sites=1, samples_per_site=24)
    return cohort.task, cohort.sites[0].train_x, cohort.sites[0].train_y


def _round(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: LossFn = classification_loss,
    spec: SubnetSpec | None = None,
    **training: object,
) -> tuple[dict[str, torch.Tensor], DistributedResult]:
    """One round from the model's own weights: (delta start - end, the result)."""
    start = {name: p.detach().clone() for name, p in federated_state(model).items()}
    config = LocalTraining(**{"steps": 3, "batch_size": 16, "lr": 0.05, **training})  # type: ignore[arg-type]
    with apply_spec(model, spec) if spec else nullcontext():
        result = train_distributed(
            lambda: model, start, x, y, config, device="cpu", loss_fn=loss_fn
        )
    return {name: start[name] - result.end_state[name] for name in start}, result


@pytest.mark.parametrize(
    ("window", "offload"),
    [(1, "disk"), (2, "host"), (4, "disk")],
    ids=["w1-disk", "w2-host", "w4-disk"],
)
def test_streamed_sgd_delta_is_bitwise_the_in_memory_delta(
    text: tuple[object, torch.Tensor, torch.Tensor], window: int, offload: str
) -> None:
    task, x, y = text
    kept, _ = _round(build_model(task, shape=SHAPE), x, y, optimizer="sgd", weight_decay=0.01)
    streamed, result = _round(
        build_model(task, shape=SHAPE),
        x,
        y,
        optimizer="sgd",
        weight_decay=0.01,
        stream_layers=True,
        window=window,
        stream_offload=offload,
    )
    assert max(float(d.abs().max()) for d in kept.values()) > 1e-4  # the round moved the weights
    assert kept.keys() == streamed.keys()
    assert all(torch.equal(kept[name], streamed[name]) for name in kept)
    assert result.peak_stream_bytes > 0


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_streamed_adaptive_optimizers_match_in_memory(
    text: tuple[object, torch.Tensor, torch.Tensor], optimizer: str
) -> None:
    """Each block's optimizer state lives in the store between steps, and comes back for the next one."""
    task, x, y = text
    common = {"optimizer": optimizer, "weight_decay": 0.01, "steps": 4}
    kept, _ = _round(build_model(task, shape=SHAPE), x, y, **common)  # type: ignore[arg-type]
    streamed, _ = _round(
        build_model(task, shape=SHAPE),
        x,
        y,
        stream_layers=True,
        window=2,
        **common,  # type: ignore[arg-type]
    )
    assert max(float(d.abs().max()) for d in kept.values()) > 1e-3
    for name in kept:
        torch.testing.assert_close(streamed[name], kept[name], rtol=1e-5, atol=1e-6)


def test_streamed_adamw_lora_lm_is_close_to_in_memory(
    notes: tuple[object, torch.Tensor, torch.Tensor],
) -> None:
    """A Llama-style LM under LoRA: the frozen bases stream read-only, the adapters train per block."""
    task, x, y = notes
    lora = LoraSpec(rank=4, alpha=8.0)
    common = {"optimizer": "adamw", "loss_fn": next_token_loss, "batch_size": 8}
    kept, _ = _round(build_model(task, shape=SHAPE, lora=lora), x, y, **common)  # type: ignore[arg-type]
    streamed, _ = _round(
        build_model(task, shape=SHAPE, lora=lora),
        x,
        y,
        stream_layers=True,
        window=2,
        **common,  # type: ignore[arg-type]
    )
    assert any("lora_A" in name for name in kept)
    assert max(float(d.abs().max()) for d in kept.values()) > 1e-3
    for name in kept:
        torch.testing.assert_close(streamed[name], kept[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bypass", [False, True], ids=["frozen", "bypassed"])
def test_hydra_site_streams_only_its_layers(
    text: tuple[object, torch.Tensor, torch.Tensor], bypass: bool
) -> None:
    task, x, y = text
    spec = SubnetSpec(layers=(1, 3), heads=((0, 2), (1,)), bypass=bypass)
    kept, _ = _round(build_model(task, shape=SHAPE), x, y, optimizer="sgd", spec=spec)
    model = build_model(task, shape=SHAPE)
    with _materialised_layers(model) as seen:
        streamed, _ = _round(model, x, y, optimizer="sgd", spec=spec, stream_layers=True, window=1)
    assert all(torch.equal(kept[name], streamed[name]) for name in kept)
    assert seen == ({1, 3} if bypass else {0, 1, 2, 3})  # a bypassed layer is never read
    arch = find_architecture(model)
    for name, delta in streamed.items():
        if arch.layer_of(name) in (0, 2):
            assert not delta.any(), name  # unselected layers do not train


@contextmanager
def _materialised_layers(model: nn.Module) -> Iterator[set[int]]:
    """The layers whose attention ran with the layer's weights present."""
    arch = find_architecture(model)
    seen: set[int] = set()

    def hook(layer: int) -> Callable[..., None]:
        block = model.get_submodule(arch.layers[layer].name)
        return lambda *_: seen.add(layer) if all(p.numel() for p in block.parameters()) else None

    hooks = [
        model.get_submodule(ref.q).register_forward_pre_hook(hook(ref.index)) for ref in arch.layers
    ]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def _census(model: nn.Module, peak: list[int]) -> Callable[[], None]:
    """Before every submodule's forward (the recompute in backward included), the bytes of block weights the
    model holds; the largest lands in peak[0]. Returns a function that removes the hooks."""
    arch = find_architecture(model)
    blocks = [model.get_submodule(ref.name) for ref in arch.layers]

    def count(*_: object) -> None:
        held = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
        peak[0] = max(peak[0], held)

    hooks = [module.register_forward_pre_hook(count) for module in model.modules()]

    def remove() -> None:
        for hook in hooks:
            hook.remove()

    return remove


@pytest.mark.parametrize("window", [1, 2])
def test_resident_block_memory_stays_under_the_window_bound(
    text: tuple[object, torch.Tensor, torch.Tensor], window: int
) -> None:
    task, x, y = text
    shape = TinyShape(hidden=32, layers=6, heads=4, intermediate=64)
    model = build_model(task, shape=shape)
    arch = find_architecture(model)
    layer_weights = [
        sum(p.numel() * p.element_size() for p in model.get_submodule(r.name).parameters())
        for r in arch.layers
    ]
    footprint = parameter_footprint(model, "adamw")
    peak = [0]
    remove = _census(model, peak)
    _, result = _round(model, x, y, optimizer="adamw", stream_layers=True, window=window)
    remove()
    assert 0 < peak[0] <= window * max(layer_weights) < sum(layer_weights)
    bound = footprint.streamed_bytes(window) - footprint.outside_bytes
    assert max(layer_weights) < result.peak_stream_bytes <= bound
    in_memory = [0]
    remove = _census(model, in_memory)
    _round(model, x, y, optimizer="adamw")
    remove()
    assert in_memory[0] == sum(layer_weights)


def test_a_model_over_the_budget_trains_only_streamed(
    text: tuple[object, torch.Tensor, torch.Tensor],
) -> None:
    task, x, y = text
    shape = TinyShape(hidden=48, layers=8, heads=4, intermediate=96)
    model = build_model(task, shape=shape)
    footprint = parameter_footprint(model, "adamw")
    budget = (footprint.streamed_bytes(2) + footprint.in_memory_bytes) // 2
    assert footprint.streamed_bytes(2) <= budget < footprint.in_memory_bytes
    with pytest.raises(MemoryBudgetError, match="--stream-layers"):
        _round(model, x, y, memory_budget_bytes=budget)
    with pytest.raises(MemoryBudgetError, match="smaller --window"):
        _round(model, x, y, memory_budget_bytes=budget, stream_layers=True, window=8)
    delta, result = _round(model, x, y, memory_budget_bytes=budget, stream_layers=True, window=2)
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-3
    assert footprint.outside_bytes + result.peak_stream_bytes <= budget


def test_streaming_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="nproc=1"):
        LocalTraining(batch_size=8, lr=0.1, stream_layers=True, nproc=2)
    with pytest.raises(ValueError, match="lm-dual"):
        LocalTraining(batch_size=8, lr=0.1, stream_layers=True, optimizer="lm-dual")
    with pytest.raises(ValueError, match="window=0"):
        LocalTraining(batch_size=8, lr=0.1, stream_layers=True, window=0)
    with pytest.raises(ValueError, match="stream_offload"):
        LocalTraining(batch_size=8, lr=0.1, stream_offload="nvme")
