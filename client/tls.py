"""How a site authenticates the coordinator (and itself, with mutual TLS), and when it must say it does not.

The checks live with the type, so every way of starting a site refuses the same incomplete or missing
certificate files with the same words, before it sends its token anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from hydrafl.netaddr import is_loopback
from hydrafl.validation import ConfigError

MUTUAL_TLS_NEEDS = "mutual TLS needs --tls-ca, --tls-cert and --tls-key together"


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteTls:
    """PEM files: the CA that signed the coordinator's certificate, and this site's own pair for mutual TLS."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError(MUTUAL_TLS_NEEDS)
        for flag, path in (
            ("--tls-ca", self.ca),
            ("--tls-cert", self.cert),
            ("--tls-key", self.key),
        ):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag} {path} is not a file")

    @classmethod
    def from_options(cls, ca: Path | None, cert: Path | None, key: Path | None) -> SiteTls | None:
        """The site's TLS files from its flags; None (clear text) when none is given."""
        if ca is None:
            if cert is not None or key is not None:
                raise ConfigError(MUTUAL_TLS_NEEDS)
            return None
        return cls(ca=ca, cert=cert, key=key)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


def plaintext_warning(coordinator: str, tls: SiteTls | None) -> str | None:
    """Why connecting to `coordinator` is unsafe, or None: without TLS, only loopback keeps the token private."""
    if tls is not None or is_loopback(coordinator):
        return None
    return (
        f"connecting to {coordinator} without TLS: the token and every update cross the network in clear text "
        "and the coordinator is not authenticated; pass --tls-ca with the CA of the coordinator's certificate"
    )
