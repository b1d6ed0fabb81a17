"""The primitives, all from `cryptography`: X25519 key agreement, HKDF-SHA256, AES-GCM for the shares routed
through the coordinator, and a ChaCha20 keystream as the mask generator."""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from hydrafl.secagg.params import SecAggError

KEY_BYTES = 32
NONCE_BYTES = 12


def new_private_key() -> bytes:
    return X25519PrivateKey.generate().private_bytes(
        Encoding.Raw, PrivateFormat.Raw, NoEncryption()
    )


def public_key(private: bytes) -> bytes:
    return (
        X25519PrivateKey.from_private_bytes(private)
        .public_key()
        .public_bytes(Encoding.Raw, PublicFormat.Raw)
    )


def agree(private: bytes, peer_public: bytes, purpose: bytes) -> bytes:
    """A 32-byte key both ends derive (X25519 then HKDF); `purpose` separates the share key from the mask seed."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError(f"a public key must be {KEY_BYTES} bytes, got {len(peer_public)}")
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(
            X25519PublicKey.from_public_bytes(peer_public)
        )
    except ValueError as error:  # an all-zero shared secret: a low-order public key
        raise SecAggError(f"unusable public key: {error}") from None
    return HKDF(
        algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=b"hydrafl-secagg " + purpose
    ).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext, or SecAggError when `sealed` was altered or was not sealed for `associated`."""
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise SecAggError(
            "a share failed authentication: altered, or sealed for another site or round"
        ) from None


def mask(seed: bytes, size: int) -> np.ndarray:
    """`size` uint32 words of the ChaCha20 keystream under `seed`: the same mask at both ends."""
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * size)), dtype="<u4").astype(
        np.uint32, copy=False
    )
