"""Shamir secret sharing of 256-bit secrets over the Mersenne prime field 2^521 - 1."""

from __future__ import annotations

import secrets

from hydrafl.secagg.params import SecAggError

PRIME = (1 << 521) - 1
SHARE_BYTES = 66
"""One share's value, big-endian; the x coordinate is the holder's position in the round."""


def split(secret: bytes, xs: list[int], threshold: int) -> dict[int, bytes]:
    """A share of `secret` for each x in `xs` (distinct, non-zero); any `threshold` of them rebuild it."""
    if not 2 <= threshold <= len(xs) or len(set(xs)) != len(xs) or min(xs) < 1:
        raise SecAggError(f"cannot split into {len(xs)} shares with threshold {threshold}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in xs}


def combine(shares: dict[int, bytes], threshold: int, secret_bytes: int = 32) -> bytes:
    """The secret from `shares` ({x: value}); every share beyond the first `threshold` must agree with them,
    so a corrupt share is caught whenever more than `threshold` arrive."""
    if len(shares) < threshold:
        raise SecAggError(f"{len(shares)} shares cannot rebuild a secret that needs {threshold}")
    points = []
    for x, value in sorted(shares.items()):
        if len(value) != SHARE_BYTES or not 1 <= x < PRIME:
            raise SecAggError(f"malformed share at x={x}")
        points.append((x, int.from_bytes(value, "big") % PRIME))
    basis, extra = points[:threshold], points[threshold:]
    for x, y in extra:
        if _interpolate(basis, x) != y:
            raise SecAggError(f"the share at x={x} disagrees with the others: one of them is corrupt")
    secret = _interpolate(basis, 0)
    if secret >= 1 << (8 * secret_bytes):
        raise SecAggError("the shares rebuild no valid secret: one of them is corrupt")
    return secret.to_bytes(secret_bytes, "big")


def _evaluate(coefficients: list[int], x: int) -> int:
    result = 0
    for coefficient in reversed(coefficients):
        result = (result * x + coefficient) % PRIME
    return result


def _interpolate(points: list[tuple[int, int]], at: int) -> int:
    """Lagrange interpolation of `points` evaluated at `at`."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                numerator = numerator * (at - xj) % PRIME
                denominator = denominator * (xi - xj) % PRIME
        total = (total + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    return total
