"""The site half of the LoRA baselines: each site trains a rank-r adapter, r the rank its message assigns
(`lora.site-rank`), and a HetLoRA site adds the paper's penalty on the tail of its rank."""

from __future__ import annotations

from hydrafl import protocol
from hydrafl.strategies.registry import register_site
from hydrafl.strategies.site import LossFn, SiteHalf, Tensors


@register_site("fedit")
@register_site("flora")
@register_site("flexlora")
@register_site("hetlora")
class LoraSite(SiteHalf):
    """Trains the assigned rank; with HetLoRA's keys, lambda ||B_tail A_tail|| joins the loss."""

    def lora_rank(self) -> int | None:
        return int(self.config[protocol.SITE_RANK]) if protocol.SITE_RANK in self.config else None

    def loss(self, loss_fn: LossFn, start: Tensors) -> LossFn:
        rank = self.lora_rank()
        if rank is None or protocol.TAIL_PENALTY not in self.config:
            return loss_fn
        from hydrafl.losses import TailPenalised  # model code, at the site only

        weight, prune = self.config[protocol.TAIL_PENALTY], self.config[protocol.TAIL_PRUNE]
        return TailPenalised(loss_fn, float(weight), rank, float(prune))  # type: ignore[arg-type]
