"""Inner optimizers leave zero-gradient parameters alone: no step, no momentum, no weight decay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hydrafl.data import load_cohort
from hydrafl.kernels.optimizers import build_inner_optimizer, skip_zero_gradients
from hydrafl.models import build_model


class TwoLayers(nn.Module):
    """hidden is a Muon matrix; `unused` never enters the loss; `gated` is multiplied by an exact zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(6, 6)
        self.unused = nn.Parameter(torch.randn(6, 6))
        self.gated = nn.Parameter(torch.randn(6, 6))
        self.classifier = nn.Linear(6, 3)
        self.gate = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.hidden(x) + self.gate * x @ self.gated))


def _steps(model: TwoLayers, optimizer_name: str, gates: list[float]) -> dict[str, torch.Tensor]:
    optimizer = build_inner_optimizer(model, optimizer_name, lr=0.05, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for gate in gates:
        model.gate = gate
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer_name", ["muon", "adamw", "sgd"])
def test_zero_gradient_parameters_are_not_updated(optimizer_name: str) -> None:
    model = TwoLayers()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    after = _steps(model, optimizer_name, [0.0, 0.0, 0.0])
    assert torch.equal(after["unused"], before["unused"])  # no gradient at all (None)
    assert torch.equal(
        after["gated"], before["gated"]
    )  # an exactly zero gradient, weight decay 0.1 notwithstanding
    assert not torch.equal(after["hidden.weight"], before["hidden.weight"])  # the rest trains


def test_muon_momentum_does_not_carry_into_a_zero_gradient_step() -> None:
    model = TwoLayers()
    optimizer = build_inner_optimizer(model, "muon", lr=0.05, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for gate in (1.0, 1.0, 0.0):
        model.gate = gate
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = model.gated.detach().clone()
        optimizer.step()
    assert torch.equal(
        model.gated.detach(), before
    )  # the last step had momentum but no gradient: untouched
    assert [p is model.gated for p in optimizer.skipped] == [True]


def test_attention_key_biases_get_rounding_noise_only_and_are_skipped() -> None:
    """Softmax is shift-invariant: the key bias's true gradient is 0, its fp32 gradient ~1e-10 relative."""
    cohort = load_cohort("tabular", num_sites=1, samples_per_site=40)
    split = cohort.sites[0]
    model = build_model(cohort.task, seed=0)
    keys = {
        name for name, _ in model.named_parameters() if name.endswith("attention.self.key.bias")
    }
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_inner_optimizer(model, "muon", lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(split.train_x[:16]), split.train_y[:16]).backward()
        raw = {name: p.grad for name, p in model.named_parameters() if name in keys}
        assert all(
            g is not None and 0 < float(g.abs().max()) for g in raw.values()
        )  # noise, not an exact 0
        optimizer.step()
    skipped = {
        name for name, p in model.named_parameters() if any(p is q for q in optimizer.skipped)
    }
    assert len(keys) == 2 and skipped == keys
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name].detach(), before[name]) for name in keys)
    moved = [name for name in before if not torch.equal(after[name].detach(), before[name])]
    assert (
        len(moved) == len(before) - len(keys) - 1
    )  # all but the key biases and the unused word embedding


def test_skip_threshold_is_the_dtype_epsilon_times_the_largest_gradient() -> None:
    big, tiny, small = (torch.zeros(3, requires_grad=True) for _ in range(3))
    big.grad = torch.tensor([1.0, -2.0, 0.5])
    tiny.grad = torch.full((3,), 2.0 * torch.finfo(torch.float32).eps * 0.99)
    small.grad = torch.full((3,), 2.0 * torch.finfo(torch.float32).eps * 1.01)
    skipped = skip_zero_gradients([big, tiny, small])
    assert len(skipped) == 1 and skipped[0] is tiny
    assert tiny.grad is None and small.grad is not None and big.grad is not None
