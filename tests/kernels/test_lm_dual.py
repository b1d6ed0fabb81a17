"""The dual Levenberg-Marquardt step equals the primal one, adapts its damping, and beats SGD on small heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hydrafl.kernels.lm_dual import LMDualOptimizer, PerSampleLoss, dual_step, residual_jacobian


def primal_step(jacobian: torch.Tensor, residual: torch.Tensor, damping: float) -> torch.Tensor:
    """(J^T J + lambda I)^-1 J^T r: the textbook P x P form the dual must reproduce."""
    curvature = jacobian.T @ jacobian + damping * torch.eye(
        jacobian.shape[1], dtype=jacobian.dtype
    )  # [P, P]
    return torch.linalg.solve(curvature, jacobian.T @ residual)


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).square().sum(dim=1)


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")


@pytest.mark.parametrize(
    ("batch", "width", "damping"), [(8, 50, 1e-3), (30, 30, 1.0), (40, 7, 1e-2), (1, 5, 10.0)]
)
def test_dual_step_equals_primal_step(batch: int, width: int, damping: float) -> None:
    gen = torch.Generator().manual_seed(batch * width)
    jacobian = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    residual = torch.randn(batch, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        dual_step(jacobian, residual, damping),
        primal_step(jacobian, residual, damping),
        atol=1e-8,
        rtol=0,
    )


@pytest.mark.parametrize("slice_size", [1, 5, 64])
def test_jacobian_in_row_slices_equals_full_jacobian(slice_size: int) -> None:
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    inputs, targets = torch.randn(13, 6, dtype=torch.float64), torch.randint(0, 3, (13,))
    params = {name: p.detach() for name, p in head.named_parameters()}

    def residuals(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(functional_call(head, p, (x,)), y).sqrt()

    jacobian, residual = residual_jacobian(
        residuals, params, inputs, targets, slice_size=slice_size
    )

    def flat_residuals(*tensors: torch.Tensor) -> torch.Tensor:
        return residuals(dict(zip(params, tensors, strict=True)), inputs, targets)

    blocks = torch.autograd.functional.jacobian(flat_residuals, tuple(params.values()))
    torch.testing.assert_close(jacobian, torch.cat([b.reshape(13, -1) for b in blocks], dim=1))
    torch.testing.assert_close(residual, flat_residuals(*params.values()))


def test_memory_is_batch_by_params_never_params_squared(largest_tensor) -> None:
    torch.manual_seed(0)
    head = nn.Linear(1000, 3)  # P = 3003
    inputs, targets = torch.randn(32, 1000), torch.randint(0, 3, (32,))
    optimizer = LMDualOptimizer(head, cross_entropy, slice_size=8)
    with largest_tensor as largest:
        optimizer.step(inputs, targets)
    assert largest.numel <= 32 * 3003


class Arctan(nn.Module):
    """r(w) = atan(w): Gauss-Newton from w = 2 overshoots to w = -3.5, where |atan| is larger."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([2.0], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.atan(x * self.w)


def test_damping_grows_and_rejects_while_the_step_overshoots_then_shrinks_once_it_is_accepted() -> (
    None
):
    head = Arctan()
    inputs, targets = torch.ones(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    optimizer = LMDualOptimizer(head, squared_error, damping=1e-3, decrease=3.0, increase=2.0)
    start = squared_error(head(inputs), targets).item()
    assert optimizer.step(inputs, targets) == start
    assert head.w.item() == 2.0
    assert optimizer.damping == pytest.approx(2e-3)
    for _ in range(10):
        damping = optimizer.damping
        if optimizer.step(inputs, targets) < start:
            break
        assert head.w.item() == 2.0
        assert optimizer.damping == pytest.approx(2 * damping)
    assert head.w.item() != 2.0
    assert optimizer.damping == pytest.approx(damping / 3)


def test_a_singular_system_counts_as_a_rejection() -> None:
    torch.manual_seed(0)
    head = nn.Linear(3, 1, bias=False)  # P = 3 < B = 40: J J^T has rank 3
    before = head.weight.detach().clone()
    optimizer = LMDualOptimizer(head, squared_error, damping=1e-10, min_damping=1e-10)
    optimizer.step(torch.randn(40, 3), torch.randn(40, 1))
    assert torch.equal(head.weight, before)
    assert optimizer.damping == pytest.approx(2e-10)


def fit(
    head: nn.Module,
    loss_fn: PerSampleLoss,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    lm: bool,
    lr: float,
) -> float:
    """The head's mean loss after 8 steps of LM or of SGD at learning rate `lr`."""
    if lm:
        optimizer = LMDualOptimizer(head, loss_fn)
        for _ in range(8):
            optimizer.step(inputs, targets)
    else:
        sgd = torch.optim.SGD(head.parameters(), lr=lr)
        for _ in range(8):
            sgd.zero_grad()
            loss_fn(head(inputs), targets).mean().backward()
            sgd.step()
    with torch.no_grad():
        return loss_fn(head(inputs), targets).mean().item()


def test_fits_a_least_squares_head_faster_than_sgd() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 10, generator=gen) * torch.linspace(
        0.2, 3, 10
    )  # ill-conditioned features
    targets = inputs @ torch.randn(10, 2, generator=gen) + 0.01 * torch.randn(64, 2, generator=gen)
    results = {}
    for lm in (True, False):
        torch.manual_seed(1)
        results[lm] = fit(
            nn.Linear(10, 2), squared_error, inputs, targets, lm=lm, lr=0.05
        )  # lr near SGD's limit
    assert results[True] < 1e-2 < results[False]


def test_fits_a_logistic_head_faster_than_sgd() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(96, 12, generator=gen)
    targets = (
        inputs @ torch.randn(12, 4, generator=gen) + 0.3 * torch.randn(96, 4, generator=gen)
    ).argmax(1)
    results = {}
    for lm in (True, False):
        torch.manual_seed(1)
        results[lm] = fit(nn.Linear(12, 4), cross_entropy, inputs, targets, lm=lm, lr=1.0)
    assert results[True] < 1e-2
    assert results[False] > 0.1


def test_errors_name_the_bad_value() -> None:
    head = nn.Linear(4, 2)
    inputs, targets = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match="damping=0"):
        dual_step(torch.randn(3, 4), torch.randn(3), 0.0)
    with pytest.raises(ValueError, match="reduction='none'"):
        LMDualOptimizer(head, F.cross_entropy).step(inputs, targets)
    with pytest.raises(ValueError, match="negative or non-finite"):
        LMDualOptimizer(head, lambda out, y: -cross_entropy(out, y)).step(inputs, targets)
    with pytest.raises(ValueError, match="no trainable parameters"):
        LMDualOptimizer(head.requires_grad_(False), cross_entropy)
    with pytest.raises(ValueError, match="decrease=1"):
        LMDualOptimizer(nn.Linear(4, 2), cross_entropy, decrease=1)
    with pytest.raises(ValueError, match="damping \\(-1"):
        LMDualOptimizer(nn.Linear(4, 2), cross_entropy, damping=-1)
    with pytest.raises(ValueError, match="slice_size=0"):
        LMDualOptimizer(nn.Linear(4, 2), cross_entropy, slice_size=0).step(inputs, targets)
