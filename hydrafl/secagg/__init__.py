"""Secure aggregation (SecAgg+-style): the coordinator learns only the sum of the sites' updates and weights.

Pure: numpy and `cryptography`, no Flower, no torch. `SiteSession` and `ServerSession` are the two ends'
state machines and `wire` their messages' flat form; `hydrafl.secure_round` (coordinator) and
`hydrafl.site_secagg` (site) carry them over the Message API.
Stages: setup (public keys), share keys (encrypted Shamir shares of the pairwise secret key and the self-mask
seed, routed through the coordinator), collect masked vectors, unmask (survivors reveal the self-mask shares
of survivors and the key shares of sites that dropped after sharing keys).
"""

from hydrafl.secagg.params import SecAggError, SecAggParams
from hydrafl.secagg.quantize import decode_sum, encode, quantisation_bound
from hydrafl.secagg.server import ServerSession
from hydrafl.secagg.site import SiteSession

__all__ = [
    "SecAggError",
    "SecAggParams",
    "ServerSession",
    "SiteSession",
    "decode_sum",
    "encode",
    "quantisation_bound",
]
