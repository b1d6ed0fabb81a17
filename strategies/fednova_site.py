"""FedNova's site half (Wang et al., NeurIPS 2020): each site reports the local steps tau_i it took, and with
`fednova-epochs` takes as many as its data needs (ceil(epochs x samples / batch)), so sites of different sizes
do different amounts of local work, the heterogeneity FedNova normalises away."""

from __future__ import annotations

import math

from flwr.app import ArrayRecord

from hydrafl.strategies.registry import register_site
from hydrafl.strategies.site import SiteHalf, Tensors

LOCAL_STEPS = "local-steps"
"""Train reply metric: the local steps tau_i this site took."""
EPOCHS = "fednova-epochs"
"""The run key of FedNova's knob: local epochs per round (0: every site takes the run's local steps)."""


@register_site("fednova")
class FedNovaSite(SiteHalf):
    def local_steps(self, steps: int, samples: int, batch_size: int) -> int:
        epochs = float(self.config.get(EPOCHS, 0.0))
        if not epochs:
            return steps
        return max(1, math.ceil(epochs * samples / min(batch_size, samples)))

    def reply(
        self, start: Tensors, end: Tensors, steps: int, lr: float
    ) -> tuple[dict[str, ArrayRecord], dict[str, float]]:
        return {}, {LOCAL_STEPS: float(steps)}
