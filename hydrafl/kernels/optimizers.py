"""Inner optimizers a site runs between two synchronisations.

Muon only makes sense for hidden 2-D weight matrices; embeddings, the classifier head and 1-D
parameters (norms, biases) stay on AdamW, as in the Muon and MuLoCo recipes.

Parameters whose gradient is zero are not stepped at all (no momentum, no weight decay): torch optimizers
skip a parameter whose `.grad` is None, so `InnerOptimizer.step` sets it to None first. "Zero" includes
rounding noise: an attention key bias has an exactly zero true gradient (softmax is shift-invariant) but gets
fp32 noise about 1e-10 of the largest gradient entry, which Adam's normalisation (AdamW, and the AdamW half
of Muon) would turn into full-size steps that differ between 1 and N processes. A gradient whose every entry
is below the dtype's machine epsilon times the model's largest gradient entry is that noise.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from hydrafl.catalog import INNER_OPTIMIZERS


class InnerOptimizer:
    """A few torch optimizers stepped together, so Muon + AdamW looks like one optimizer to the trainer."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.skipped: list[torch.Tensor] = []
        """The parameters the last `step` left untouched because their gradient was zero."""

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def step(self, *, largest: float = 0.0) -> None:
        """`largest`: a gradient peak of parameters outside this optimizer that the zero-gradient rule also
        compares against (layer streaming steps a model's blocks with optimizers of their own)."""
        params = [
            p
            for optimizer in self.optimizers
            for group in optimizer.param_groups
            for p in group["params"]
        ]
        self.skipped = skip_zero_gradients(params, largest=largest)
        for optimizer in self.optimizers:
            optimizer.step()


def skip_zero_gradients(
    params: Iterable[torch.Tensor], *, largest: float = 0.0
) -> list[torch.Tensor]:
    """Set `.grad = None` on parameters whose gradient is zero up to rounding noise (against the larger of
    their own peak and `largest`); returns them."""
    with_grad = [(p, p.grad) for p in params if p.grad is not None]
    if not with_grad:
        return []
    peaks = torch.stack([grad.detach().abs().amax().float() for _, grad in with_grad])  # [P]
    largest = max(float(peaks.max()), largest)
    zero = [
        p
        for (p, grad), peak in zip(with_grad, peaks.tolist(), strict=True)
        if zero_gradient(peak, grad, largest)
    ]
    for p in zero:
        p.grad = None
    return zero


def zero_gradient(peak: float, grad: torch.Tensor, largest: float) -> bool:
    """Whether a gradient whose largest entry is `peak` is rounding noise next to the model's `largest`."""
    return peak <= torch.finfo(grad.dtype).eps * largest


def _is_muon_matrix(name: str, param: nn.Parameter) -> bool:
    lowered = name.lower()
    return param.ndim == 2 and not any(
        key in lowered for key in ("embed", "classifier", "head", "feature_")
    )


def build_inner_optimizer(
    model: nn.Module, name: str, *, lr: float, weight_decay: float = 0.0
) -> InnerOptimizer:
    """Build the inner optimizer `name` (adamw, sgd or muon) over the model's trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return inner_optimizer(named, name, lr=lr, weight_decay=weight_decay)


def inner_optimizer(
    named: list[tuple[str, nn.Parameter]], name: str, *, lr: float, weight_decay: float = 0.0
) -> InnerOptimizer:
    """The inner optimizer `name` over the `named` parameters (none: an optimizer that does nothing)."""
    if not named and name in ("adamw", "sgd", "muon"):
        return InnerOptimizer([])
    if name == "adamw":
        return InnerOptimizer(
            [torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay)]
        )
    if name == "sgd":
        return InnerOptimizer(
            [torch.optim.SGD([p for _, p in named], lr=lr, weight_decay=weight_decay)]
        )
    if name == "muon":
        matrices = [p for n, p in named if _is_muon_matrix(n, p)]
        others = [p for n, p in named if not _is_muon_matrix(n, p)]
        optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            optimizers.append(
                torch.optim.Muon(
                    matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
                )
            )
        if others:
            optimizers.append(torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay))
        return InnerOptimizer(optimizers)
    if name == "lm-dual":
        raise ValueError(
            "lm-dual is head-only Levenberg-Marquardt (kernels.lm_dual.HeadLM), not a gradient optimizer"
        )
    raise ValueError(
        f"unknown inner optimizer {name!r}; choose one of {', '.join(INNER_OPTIMIZERS)}"
    )
