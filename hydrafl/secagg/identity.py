"""Who a site is, in a form the coordinator cannot forge: the consortium's Ed25519 key certifies each site's
Ed25519 signing key for its node id, and every site pins the consortium's public key (given to it out of band
with its token). A site signs its round keys and the survivor set with its signing key; a peer checks the
certificate and the signature, so a coordinator that only routes them can neither swap a key nor tell two sites
two different survivor sets (Bonawitz et al., CCS 2017, the active-adversary variant).

The admin holds the consortium's private key off the coordinator (`hydrafl admin consortium create`) and
issues a site's identity when it enrols (`hydrafl admin site add --consortium-key`); a simulation issues its
in-process sites' identities itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from hydrafl.secagg.params import SecAggError

KEY_BYTES = 32
SIGNATURE_BYTES = 64


def new_signing_key() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(
        Encoding.Raw, PrivateFormat.Raw, NoEncryption()
    )


def verifying_key(private: bytes) -> bytes:
    return (
        Ed25519PrivateKey.from_private_bytes(private)
        .public_key()
        .public_bytes(Encoding.Raw, PublicFormat.Raw)
    )


def sign(private: bytes, statement: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).sign(statement)


def verify(public: bytes, signature: bytes, statement: bytes, what: str) -> None:
    """Raise SecAggError naming `what` unless `signature` is `public`'s over `statement`."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, statement)
    except (InvalidSignature, ValueError):
        raise SecAggError(
            f"{what}: the signature does not verify; the coordinator altered or forged it"
        ) from None


def certificate_statement(node: int, signing_key: bytes) -> bytes:
    """What the consortium signs at enrolment: this node id holds this signing key."""
    return b"hydrafl-secagg-site|%d|" % node + signing_key


def certify(consortium_private: bytes, node: int, signing_key: bytes) -> bytes:
    return sign(consortium_private, certificate_statement(node, signing_key))


@dataclass(frozen=True, slots=True)
class SiteIdentity:
    """A site's long-term secure-aggregation identity: kept by the site, never sent whole to the coordinator."""

    node: int
    signing_key: bytes
    """Ed25519 private key, raw."""
    certificate: bytes
    """The consortium's signature over (node, the signing key's public half)."""
    consortium_key: bytes
    """The consortium's Ed25519 public key: the one key this site trusts to certify its peers."""

    @classmethod
    def issue(cls, consortium_private: bytes, node: int) -> SiteIdentity:
        """A new identity for `node`, certified by the consortium (at enrolment, or by a simulation)."""
        signing_key = new_signing_key()
        return cls(
            node,
            signing_key,
            certify(consortium_private, node, verifying_key(signing_key)),
            verifying_key(consortium_private),
        )

    @property
    def public_key(self) -> bytes:
        return verifying_key(self.signing_key)

    def sign(self, statement: bytes) -> bytes:
        return sign(self.signing_key, statement)

    def check_peer(self, node: int, signing_key: bytes, certificate: bytes) -> None:
        """Raise SecAggError unless the consortium certified `signing_key` for `node`."""
        verify(
            self.consortium_key,
            certificate,
            certificate_statement(node, signing_key),
            f"site {node}'s certificate",
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "node": self.node,
                "signing-key": _text(self.signing_key),
                "certificate": _text(self.certificate),
                "consortium-key": _text(self.consortium_key),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> SiteIdentity:
        """An identity file's content; SecAggError when it is malformed or its certificate is not the
        consortium's for its own key."""
        try:
            data = json.loads(text)
            identity = cls(
                int(data["node"]),
                _raw(data["signing-key"], KEY_BYTES),
                _raw(data["certificate"], SIGNATURE_BYTES),
                _raw(data["consortium-key"], KEY_BYTES),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise SecAggError(f"not a secure-aggregation identity: {error}") from None
        identity.check_peer(identity.node, identity.public_key, identity.certificate)
        return identity


def seed_commitment(server_round: int, node: int, seed: bytes) -> bytes:
    """What a site publishes (signed) about its self-mask seed: a rebuilt seed must hash to it."""
    return hashlib.sha256(b"hydrafl-secagg-seed|%d|%d|" % (server_round, node) + seed).digest()


def _text(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _raw(text: str, size: int) -> bytes:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != size:
        raise ValueError(f"a {size}-byte field holds {len(raw)} bytes")
    return raw
