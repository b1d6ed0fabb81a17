from __future__ import annotations

import itertools
import os

import pytest

from hydrafl.secagg import SecAggError
from hydrafl.secagg.shamir import SHARE_BYTES, combine, split


def test_any_threshold_shares_rebuild_the_secret_and_fewer_refuse():
    secret = os.urandom(32)
    shares = split(secret, [1, 2, 3, 4, 5], 3)
    for subset in itertools.combinations(shares, 3):
        assert combine({x: shares[x] for x in subset}, 3) == secret
    with pytest.raises(SecAggError, match="2 shares cannot rebuild a secret that needs 3"):
        combine({1: shares[1], 2: shares[2]}, 3)


def test_a_corrupt_share_beyond_the_threshold_is_caught():
    shares = split(os.urandom(32), [1, 2, 3, 4], 3)
    shares[4] = bytes(SHARE_BYTES - 1) + b"\x01"
    with pytest.raises(SecAggError, match="x=4 disagrees"):
        combine(shares, 3)
