"""Levenberg-Marquardt in its dual form (LeMA), as a site's inner optimizer for head-only fine-tuning.

Levenberg-Marquardt minimises sum_i r_i(theta)^2 with the damped Gauss-Newton step

    primal  delta = (J^T J + lambda I)^-1 J^T r      a P x P solve: O(P^2) memory
    dual    delta = J^T (J J^T + lambda I)^-1 r      a B x B solve: O(B^2 + B P) memory

(J [B, P] the residual Jacobian, r [B] the residuals, theta <- theta - delta). Both are the same vector (push-
through identity), and for a head with P in the tens of thousands and a batch B of a few hundred only the dual
fits. J itself is built `slice_size` rows at a time with `torch.func.jacrev`, so nothing P x P ever exists.

Residuals. Any non-negative per-sample loss l_i becomes a residual r_i = sqrt(l_i), so sum_i r_i^2 is the
summed loss and J^T r = (1/2) grad sum_i l_i. For a squared error with one output this is classic
Levenberg-Marquardt exactly; for cross-entropy it is Gauss-Newton on square-root losses, whose curvature
J^T J = sum_i grad l_i grad l_i^T / (4 l_i) weighs each sample's outer-product gradient by its inverse loss.
We chose it over the softmax-output residual (p - onehot) because it minimises the loss the site reports,
so accepting a step on "the loss went down" is consistent with the objective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev

PerSampleLoss = Callable[
    [Tensor, Tensor], Tensor
]  # (outputs [B, ...], targets [B, ...]) -> losses [B]
ResidualFn = Callable[
    [dict[str, Tensor], Tensor, Tensor], Tensor
]  # (params, inputs, targets) -> r [k]

SQRT_FLOOR = 1e-12  # keeps d sqrt(l) / dl finite at l = 0; shifts sum r^2 by a constant only


def dual_step(jacobian: Tensor, residual: Tensor, damping: float) -> Tensor:
    """delta [P] = J^T (J J^T + lambda I)^-1 r for J [B, P], r [B]: the damped Gauss-Newton step, B x B solve."""
    if damping <= 0:
        raise ValueError(f"damping={damping} must be > 0 (it keeps J J^T + lambda I invertible)")
    gram = jacobian @ jacobian.T  # [B, B]
    gram.diagonal().add_(damping)
    factor = torch.linalg.cholesky(gram)  # [B, B]
    alpha = torch.cholesky_solve(residual.unsqueeze(1), factor)  # [B, 1] = (J J^T + lambda I)^-1 r
    return jacobian.T @ alpha.squeeze(1)  # [P]


def residual_jacobian(
    residual_fn: ResidualFn,
    params: dict[str, Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    slice_size: int,
) -> tuple[Tensor, Tensor]:
    """(J [B, P], r [B]): the residuals and their Jacobian in the order of `params`, `slice_size` rows at a time."""
    if slice_size < 1:
        raise ValueError(
            f"slice_size={slice_size} must be >= 1 (rows of the Jacobian built at a time)"
        )

    def with_value(p: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        r = residual_fn(p, x, y)  # [k]
        return r, r.detach()

    batch = inputs.shape[0]
    width = sum(p.numel() for p in params.values())  # P
    jacobian = torch.empty(
        batch, width, dtype=next(iter(params.values())).dtype, device=inputs.device
    )  # [B, P]
    residual = torch.empty(batch, dtype=jacobian.dtype, device=inputs.device)  # [B]
    for start in range(0, batch, slice_size):
        rows = slice(start, min(start + slice_size, batch))
        blocks, residual[rows] = jacrev(with_value, has_aux=True)(
            params, inputs[rows], targets[rows]
        )
        jacobian[rows] = torch.cat(
            [b.reshape(rows.stop - rows.start, -1) for b in blocks.values()], dim=1
        )  # [k, P]
    return jacobian, residual


class LMDualOptimizer:
    """Levenberg-Marquardt with adaptive damping for a small head: `loss = opt.step(inputs, targets)`.

    loss_fn returns one non-negative loss per sample, e.g.
    `lambda out, y: F.cross_entropy(out, y, reduction="none")`. Each step proposes the dual step on the
    batch; if it lowers the batch's mean loss it is taken and lambda shrinks by `decrease` (trust the
    Gauss-Newton model more), otherwise the parameters stay and lambda grows by `increase`.
    """

    def __init__(
        self,
        head: nn.Module,
        loss_fn: PerSampleLoss,
        *,
        damping: float = 1e-2,
        decrease: float = 3.0,
        increase: float = 2.0,
        min_damping: float = 1e-10,
        max_damping: float = 1e10,
        slice_size: int = 64,
    ) -> None:
        if not 0 < min_damping <= damping <= max_damping:
            raise ValueError(
                f"need 0 < min_damping ({min_damping}) <= damping ({damping}) <= max_damping ({max_damping})"
            )
        if decrease <= 1 or increase <= 1:
            raise ValueError(
                f"decrease={decrease} and increase={increase} must be > 1 (they multiply lambda)"
            )
        self.params = {name: p for name, p in head.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError(
                f"{type(head).__name__} has no trainable parameters; unfreeze the head first"
            )
        self.head, self.loss_fn = head, loss_fn
        self.damping, self.decrease, self.increase = damping, decrease, increase
        self.min_damping, self.max_damping, self.slice_size = min_damping, max_damping, slice_size

    def _per_sample_loss(
        self, params: dict[str, Tensor], inputs: Tensor, targets: Tensor
    ) -> Tensor:
        """l_i [B] at `params`, checked to be one loss per sample."""
        losses = self.loss_fn(functional_call(self.head, params, (inputs,)), targets)
        if losses.shape != inputs.shape[:1]:
            raise ValueError(
                f"loss_fn returned shape {tuple(losses.shape)}, expected one loss per sample [{inputs.shape[0]}]; "
                "use reduction='none'"
            )
        return losses

    def _residuals(self, params: dict[str, Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
        return torch.sqrt(self._per_sample_loss(params, inputs, targets) + SQRT_FLOOR)  # r [k]

    def _grow_damping(self) -> None:
        self.damping = min(self.damping * self.increase, self.max_damping)

    def step(self, inputs: Tensor, targets: Tensor) -> float:
        """One damped step on this batch; returns its mean loss after the step (the loss before it if rejected)."""
        current = {name: p.detach() for name, p in self.params.items()}
        jacobian, residual = residual_jacobian(
            self._residuals, current, inputs, targets, slice_size=self.slice_size
        )
        if not torch.isfinite(residual).all():
            raise ValueError(
                "loss_fn gave a negative or non-finite per-sample loss; sqrt(loss) residuals need l >= 0"
            )
        with torch.no_grad():
            loss = float(self._per_sample_loss(current, inputs, targets).mean())
            try:
                delta = dual_step(jacobian, residual, self.damping)  # [P]
            except (
                torch.linalg.LinAlgError
            ):  # J J^T + lambda I not numerically positive definite: damp more
                self._grow_damping()
                return loss
            pieces = delta.split([p.numel() for p in current.values()])
            trial = {
                name: p - piece.view_as(p)
                for (name, p), piece in zip(current.items(), pieces, strict=True)
            }
            trial_loss = float(self._per_sample_loss(trial, inputs, targets).mean())
            if trial_loss >= loss:
                self._grow_damping()
                return loss
            for name, p in self.params.items():
                p.copy_(trial[name])
        self.damping = max(self.damping / self.decrease, self.min_damping)
        return trial_loss


class HeadLM:
    """`LMDualOptimizer` as a site's inner optimizer for head-only fine-tuning (`--inner-optimizer lm-dual`).

    Only `head` trains: each step runs the model without gradients (eval mode: no dropout, so the features are
    a function of the weights and the batch) to catch the head's input features, then takes one damped dual
    step of the head on them with per-sample cross-entropy. Everything else keeps its start value, so the
    site's delta is zero outside the head.
    """

    def __init__(self, model: nn.Module, head: nn.Module, **options: float) -> None:
        self.model, self.head = model, head
        self.optimizer = LMDualOptimizer(head, _per_sample_cross_entropy, **options)

    def features(self, x: Tensor) -> Tensor:
        caught: list[Tensor] = []
        hook = self.head.register_forward_pre_hook(
            lambda _module, args: caught.append(args[0].detach())
        )
        was_training = self.model.training
        try:
            self.model.eval()
            with torch.no_grad():
                self.model(x)
        finally:
            hook.remove()
            self.model.train(was_training)
        if len(caught) != 1:
            raise ValueError(f"the head ran {len(caught)} times in one forward pass; expected once")
        return caught[0]

    def step(self, x: Tensor, y: Tensor) -> float:
        """One step on the batch; its mean loss after the step (before it, when the step was rejected)."""
        return self.optimizer.step(self.features(x), y)


def _per_sample_cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits, y, reduction="none")
