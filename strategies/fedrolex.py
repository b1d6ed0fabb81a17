"""FedRolex: HeteroFL whose kept channels are a rolling window: at round t every block keeps the channels
t-1, t, ... (mod the block size, wrapping around), so over rounds every coordinate is trained even by narrow
sites. Same plain mean over the sites that trained a coordinate.

Alam, Liu, Yan, Zhang, "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model Extraction",
NeurIPS 2022.
"""

from __future__ import annotations

from typing import Any

from hydrafl.strategies.heterofl import HeteroFL


class FedRolex(HeteroFL):
    """HeteroFL with the width window advanced by one channel per round."""

    def _width(self, ratio: float) -> dict[str, Any]:
        return {"width_ratio": ratio, "width_offset": self.server_round - 1}
