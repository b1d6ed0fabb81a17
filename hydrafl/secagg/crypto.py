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


BLOCK_WORDS = 16
"""uint32 words in one ChaCha20 block (64 bytes)."""
MASK_WORDS = BLOCK_WORDS << 32
"""The longest mask: ChaCha20's block counter is 32 bits (a 275 GB keystream)."""


def mask(seed: bytes, size: int) -> np.ndarray:
    """`size` uint32 words of the ChaCha20 keystream under `seed`: the same mask at both ends."""
    return mask_range(seed, 0, size)


def mask_range(seed: bytes, offset: int, count: int) -> np.ndarray:
    """Words [offset, offset + count) of `mask(seed, ...)`, made without the words before them: ChaCha20 is a
    counter-mode stream, and its 16-byte nonce starts with the little-endian block counter. A vector larger than
    memory is masked and unmasked a window at a time."""
    if offset < 0 or count < 0 or offset + count > MASK_WORDS:
        raise SecAggError(f"mask words {offset}..{offset + count} are outside 0..{MASK_WORDS}")
    block, skip = divmod(offset, BLOCK_WORDS)
    nonce = block.to_bytes(4, "little") + bytes(12)
    encryptor = Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * (skip + count)))
    return np.frombuffer(stream, dtype="<u4", offset=4 * skip).astype(np.uint32, copy=False)


Masks = list[tuple[bytes, bool]]
"""Mask seeds, each with whether its mask is added to the vector (else subtracted)."""


def apply_masks(
    values: np.ndarray, offset: int, masks: Masks, *, remove: bool = False
) -> np.ndarray:
    """`values` (words [offset, offset + len) of a uint32 vector), changed in place and returned, with `masks`
    applied to them (mod 2^32), or, `remove`, taken back out: a site masks, and the coordinator unmasks, a window
    at a time as well as whole."""
    for seed, added in masks:
        words = mask_range(seed, offset, values.size)
        (np.add if added != remove else np.subtract)(values, words, out=values)
    return values
