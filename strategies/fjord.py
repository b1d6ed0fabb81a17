"""FjORD: ordered dropout. A site of maximum width p_max trains nested leading slices: before every local step it
draws a width p <= p_max, so narrow widths are trained by every site and wide ones only by capable sites. The
coordinator averages each nested block [:p] over the sites with p_max >= p, weighted by their samples, which is
the masked per-coordinate mean over the sites' p_max slices.

Horvath et al., "FjORD: Fair and Accurate Federated Learning under heterogeneous targets with Ordered Dropout",
NeurIPS 2021 (without the optional self-distillation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydrafl.strategies.heterofl import HeteroFL

LEVELS = (0.2, 0.4, 0.6, 0.8, 1.0)
"""The paper's uniform width levels; a site draws among those below its p_max, and p_max itself."""


class FjORD(HeteroFL):
    """HeteroFL's tier-matched widths as p_max, ordered dropout at the sites, sample-weighted nested averaging."""

    count_once = False

    def __init__(self, *, levels: Sequence[float] = LEVELS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not levels or not all(0 < v <= 1 for v in levels):
            raise ValueError(f"FjORD needs width levels in (0, 1], got {list(levels)}")
        self.levels = tuple(sorted(set(levels)))

    def _width(self, ratio: float) -> dict[str, Any]:
        # Hydra.configure_train files each site's spec before building the next: len(specs) numbers the sites.
        seed = self.server_round * 1_000_003 + len(self.specs)
        return {"width_ratio": ratio, "width_levels": self.levels, "width_seed": seed}
