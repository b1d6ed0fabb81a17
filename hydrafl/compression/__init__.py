"""Compressed updates with error feedback (`--compress`): bf16, int8 and int4 with per-block scales, top-k
sparsification and PowerSGD low-rank factors. `layout` says what travels (torch-free, for the coordinator's edge
check), `codecs` encodes and decodes, `feedback` keeps the site's residuals, `receive` decodes replies where
they enter the server side. Downloads (`--compress-downloads`): `downloads` is the coordinator's side, with the
error feedback, `reference` the site's."""

from hydrafl.compression.layout import SCHEMES, CompressionError, Scheme

__all__ = ["SCHEMES", "CompressionError", "Scheme"]
