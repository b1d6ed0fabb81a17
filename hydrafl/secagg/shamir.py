"""Shamir secret sharing of 256-bit secrets over the Mersenne prime field 2^521 - 1."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable

from hydrafl.secagg.params import SecAggError

PRIME = (1 << 521) - 1
SHARE_BYTES = 66
"""One share's value, big-endian; the x coordinate is the holder's position in the round."""


def split(secret: bytes, xs: list[int], threshold: int) -> dict[int, bytes]:
    """A share of `secret` for each x in `xs` (distinct, non-zero); any `threshold` of them rebuild it."""
    if not 2 <= threshold <= len(xs) or len(set(xs)) != len(xs) or min(xs) < 1:
        raise SecAggError(f"cannot split into {len(xs)} shares with threshold {threshold}")
    coefficients = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    return {x: _evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in xs}


MAX_SUBSETS = 4096
"""Subsets `recover` tries before giving up: enough to leave out any one or two of 90 shares."""


def recover(
    shares: dict[int, bytes], threshold: int, valid: Callable[[bytes], bool]
) -> tuple[bytes, list[int]]:
    """(the secret, the xs of the shares that disagree with it): the secret `valid` accepts, rebuilt from
    `shares` leaving out as few as it must. A corrupt share is outvoted only when more than `threshold` arrive;
    SecAggError when no subset rebuilds a valid secret (with exactly `threshold` shares: one is corrupt)."""
    if len(shares) < threshold:
        raise SecAggError(f"{len(shares)} shares cannot rebuild a secret that needs {threshold}")
    points = []
    for x, value in sorted(shares.items()):
        if len(value) != SHARE_BYTES or not 1 <= x < PRIME:
            raise SecAggError(f"malformed share at x={x}")
        points.append((x, int.from_bytes(value, "big") % PRIME))
    subsets = (
        [p for p in points if p[0] not in left_out][:threshold]
        for dropped in range(len(points) - threshold + 1)
        for left_out in map(set, itertools.combinations([x for x, _ in points], dropped))
    )
    for basis in itertools.islice(subsets, MAX_SUBSETS):
        value = _interpolate(basis, 0)
        if value < 1 << 256 and valid(secret := value.to_bytes(32, "big")):
            return secret, [x for x, y in points if _interpolate(basis, x) != y]
    raise SecAggError(
        f"no {threshold} of the {len(points)} shares rebuild the committed secret: a share is corrupt"
    )


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
