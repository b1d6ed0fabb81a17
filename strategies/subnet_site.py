"""The site half of the strategies that give each site a subnetwork (Hydra-nets, the width baselines): the
site trains the SubnetSpec its message carries (`hydra.*` keys) and replies with exactly its slices."""

from __future__ import annotations

from hydrafl import protocol
from hydrafl.strategies.registry import register_site
from hydrafl.strategies.site import SiteHalf
from hydrafl.subnet.spec import SubnetSpec


@register_site("hydra")
@register_site("heterofl")
@register_site("fjord")
@register_site("fedrolex")
@register_site("fedbuff-hydra")
class SubnetSite(SiteHalf):
    """Trains the assigned subnetwork; a message without one (no spec assigned) trains the whole model."""

    def subnet(self) -> SubnetSpec | None:
        if f"{protocol.SUBNET_PREFIX}layers" not in self.config:
            return None
        return SubnetSpec.from_config(self.config)
