from __future__ import annotations

import itertools
import os

import pytest

from hydrafl.secagg import SecAggError
from hydrafl.secagg.shamir import SHARE_BYTES, recover, split


def test_any_threshold_shares_rebuild_the_secret_and_fewer_refuse():
    secret = os.urandom(32)
    shares = split(secret, [1, 2, 3, 4, 5], 3)
    for subset in itertools.combinations(shares, 3):
        assert recover({x: shares[x] for x in subset}, 3, lambda s: s == secret) == (secret, [])
    with pytest.raises(SecAggError, match="2 shares cannot rebuild a secret that needs 3"):
        recover({1: shares[1], 2: shares[2]}, 3, lambda s: True)


@pytest.mark.parametrize("corrupt", [[1], [4], [2, 5]])
def test_corrupt_shares_beyond_the_threshold_are_outvoted_and_named(corrupt):
    secret = os.urandom(32)
    shares = split(secret, [1, 2, 3, 4, 5], 3)
    for x in corrupt:
        shares[x] = bytes(SHARE_BYTES - 1) + b"\x01"
    assert recover(shares, 3, lambda s: s == secret) == (secret, corrupt)


def test_a_corrupt_share_at_exactly_the_threshold_rebuilds_nothing():
    secret = os.urandom(32)
    shares = split(secret, [1, 2, 3], 3)
    shares[2] = split(os.urandom(32), [1, 2, 3], 3)[
        2
    ]  # in range: a plain range check would pass it
    with pytest.raises(SecAggError, match="no 3 of the 3 shares rebuild the committed secret"):
        recover(shares, 3, lambda s: s == secret)
