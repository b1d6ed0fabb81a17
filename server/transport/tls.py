"""How the coordinator proves who it is (and asks sites to, with mutual TLS), and when it must warn it does not.

The checks live with the type, so a command line, a TOML file and a test all refuse the same incomplete or
missing certificate files with the same words, before anything listens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from hydrafl.netaddr import is_loopback
from hydrafl.validation import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTls:
    """PEM files. With `client_ca`, every site must present a certificate signed by it (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        for flag, path in (
            ("--tls-cert", self.cert),
            ("--tls-key", self.key),
            ("--tls-client-ca", self.client_ca),
        ):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag} {path} is not a file")

    @classmethod
    def from_options(
        cls, cert: Path | None, key: Path | None, client_ca: Path | None
    ) -> ServerTls | None:
        """The coordinator's TLS files from its options; None (clear text) when none is given."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
            return None
        if cert is None or key is None:
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        return cls(cert=cert, key=key, client_ca=client_ca)

    @property
    def mode(self) -> str:
        return "mutual TLS" if self.client_ca else "TLS"

    def credentials(self) -> grpc.ServerCredentials:
        root = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=root,
            require_client_auth=root is not None,
        )


def plaintext_warning(listen: str, tls: ServerTls | None) -> str | None:
    """Why listening on `listen` is unsafe, or None: without TLS, only loopback keeps tokens and updates private."""
    if tls is not None or is_loopback(listen):
        return None
    return (
        f"listening on {listen} WITHOUT TLS: site tokens and model updates cross the network in clear text; "
        "use --tls-cert/--tls-key, or listen on 127.0.0.1 behind a TLS-terminating proxy"
    )
