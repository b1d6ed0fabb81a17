"""Secure aggregation (SecAgg+-style): the coordinator learns only the sum of the sites' updates, weights and
weighted metrics (`quantize.encode_metrics`).

Pure: numpy and `cryptography`, no Flower, no torch. `SiteSession` and `ServerSession` are the two ends'
state machines and `wire` their messages' flat form; `hydrafl.server.aggregation.secure_round` (coordinator) and
`hydrafl.client.site_secagg` (site) carry them over the Message API.
Stages: setup (signed public keys and a commitment to the self-mask seed), share keys (encrypted Shamir shares
of the pairwise secret key and the self-mask seed, routed through the coordinator), collect masked vectors,
consistency check (survivors sign the survivor set), unmask (survivors reveal the self-mask shares of survivors
and the key shares of sites that dropped after sharing keys). `noise` is distributed DP: each site's clip and
Skellam noise share, added before masking. `identity` is what makes the coordinator's routing
checkable: the consortium certifies each site's signing key (Bonawitz et al., CCS 2017, active adversary).
"""

from hydrafl.secagg.identity import SiteIdentity
from hydrafl.secagg.params import SecAggError, SecAggParams
from hydrafl.secagg.quantize import (
    decode_metrics,
    decode_sum,
    encode,
    encode_metrics,
    metric_bound,
    quantisation_bound,
)
from hydrafl.secagg.server import ServerSession
from hydrafl.secagg.site import SiteSession

__all__ = [
    "SecAggError",
    "SecAggParams",
    "ServerSession",
    "SiteIdentity",
    "SiteSession",
    "decode_metrics",
    "decode_sum",
    "encode",
    "encode_metrics",
    "metric_bound",
    "quantisation_bound",
]
