"""A site's state machine refuses what a coordinator should not send, and reveals no site's secrets twice."""

from __future__ import annotations

import numpy as np
import pytest
from secagg_rounds import started

from hydrafl.secagg import SecAggError, SecAggParams, SiteSession

NODES = [1, 2, 3, 4, 5]


def test_a_share_routed_to_the_wrong_site_fails_authentication_and_changes_nothing():
    server, sites = started(NODES, SecAggParams(), 4)
    for_two = server.shares_for(2)
    wrong = {**server.shares_for(3), 1: for_two[1]}  # site 1's share sealed for site 2, handed to site 3
    with pytest.raises(SecAggError, match="failed authentication"):
        sites[3].mask(np.zeros(4, np.uint32), wrong)
    assert sites[3].stage == "shared" and set(sites[3].held) == {3}
    tampered = dict(for_two)
    tampered[1] = tampered[1][:-1] + bytes([tampered[1][-1] ^ 1])
    with pytest.raises(SecAggError, match="failed authentication"):
        sites[2].mask(np.zeros(4, np.uint32), tampered)
    assert sites[2].mask(np.zeros(4, np.uint32), for_two).shape == (4,)


def test_a_share_from_a_site_outside_the_neighbourhood_is_refused():
    server, sites = started(NODES, SecAggParams(), 4)
    with pytest.raises(SecAggError, match="site 9, which is not one of its neighbours"):
        sites[1].mask(np.zeros(4, np.uint32), {**server.shares_for(1), 9: b"x" * 176})


def test_keys_without_its_own_or_from_strangers_are_refused():
    site = SiteSession.start(1, 1, [1, 2, 3, 4, 5, 6, 7], SecAggParams(num_shares=3, reconstruction_threshold=2))
    other = SiteSession.start(4, 1, [1, 2, 3, 4, 5, 6, 7], site.params)
    with pytest.raises(SecAggError, match="does not hold this site's own public keys"):
        site.share_keys({2: other.public_keys()})
    with pytest.raises(SecAggError, match=r"outside its neighbourhood: \[4\]"):
        site.share_keys({1: site.public_keys(), 4: other.public_keys()})
    assert site.stage == "keys"


def test_a_site_answers_unmasking_once_and_never_for_a_site_called_both_alive_and_dropped():
    server, sites = started(NODES, SecAggParams(), 4)
    sites[1].mask(np.zeros(4, np.uint32), server.shares_for(1))
    with pytest.raises(SecAggError, match="inconsistent unmask request"):
        sites[1].unmask([1, 2, 3], [3, 4])
    revealed = sites[1].unmask([1, 2, 3], [4, 5])
    assert set(revealed) == {1, 2, 3, 4, 5}
    with pytest.raises(SecAggError, match="in stage 'done'"):
        sites[1].unmask([1, 2, 3, 4], [5])


def test_a_session_survives_its_round_trip_through_text():
    server, sites = started(NODES, SecAggParams(), 4)
    restored = SiteSession.from_state(sites[2].to_state())
    assert restored == sites[2]
    assert restored.mask(np.zeros(4, np.uint32), server.shares_for(2)).shape == (4,)


def test_a_round_without_this_site_is_refused():
    with pytest.raises(SecAggError, match="site 9 is not among"):
        SiteSession.start(9, 1, [1, 2, 3], SecAggParams())
