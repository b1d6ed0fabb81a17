"""Which global arrays are LoRA factor pairs: PEFT names A `<module>.lora_A.<adapter>.weight` [R, in] and B
`<module>.lora_B.<adapter>.weight` [out, R]. Torch-free naming rules, shared by the strategies that aggregate
the pairs and by the site losses that penalise them, and HetLoRA's rank-pruning rule both ends apply."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass


class LoraPairError(ValueError):
    """The global arrays hold an A without its B, or no pair where LoRA is required."""


_LORA_A = re.compile(r"^(?P<module>.+)\.lora_A\.(?P<adapter>[^.]+)\.weight$")


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One adapted module: A [R, in] and B [out, R] by array name; the update is B A (times alpha / R)."""

    module: str
    a: str
    b: str

    @property
    def base(self) -> str:
        """The module's frozen base weight (PEFT's `base_layer`)."""
        return f"{self.module}.base_layer.weight"


def lora_pairs(names: Iterable[str], *, required: bool = True) -> list[LoraPair]:
    """Every (A, B) pair among `names`. LoraPairError when an A has no B, or, if `required`, when there is
    no pair at all (the run has no LoRA)."""
    names = set(names)
    pairs = []
    for name in sorted(names):
        if match := _LORA_A.match(name):
            b = f"{match['module']}.lora_B.{match['adapter']}.weight"
            if b not in names:
                raise LoraPairError(
                    f"LoRA factor {name!r} has no matching {b!r} among the global arrays"
                )
            pairs.append(LoraPair(match["module"], name, b))
    if required and not pairs:
        raise LoraPairError(
            "no LoRA factors among the global arrays: the LoRA baselines need --lora-rank R >= 1"
        )
    return pairs


def pruned_rank(rank: int, prune: float) -> int:
    """A LoRA rank after one HetLoRA self-pruning step drops its last `prune` fraction (at least 1 is kept)."""
    return max(1, math.floor((1 - prune) * rank))
