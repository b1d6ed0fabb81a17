"""A site's state machine refuses what a coordinator should not send, and reveals no site's secrets twice."""

from __future__ import annotations

import numpy as np
import pytest
from secagg_rounds import identities, sessions, started

from hydrafl.secagg import SecAggError, SecAggParams, SiteSession

NODES = [1, 2, 3, 4, 5]


def test_a_share_routed_to_the_wrong_site_fails_authentication_and_changes_nothing():
    server, sites = started(NODES, SecAggParams(), 4)
    for_two = server.shares_for(2)
    wrong = {
        **server.shares_for(3),
        1: for_two[1],
    }  # site 1's share sealed for site 2, handed to site 3
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
    ring = sessions([1, 2, 3, 4, 5, 6, 7], SecAggParams(num_shares=3, reconstruction_threshold=2))
    site, other = ring[1], ring[4]
    with pytest.raises(SecAggError, match="does not hold this site's own public keys"):
        site.share_keys({2: other.public_keys()})
    with pytest.raises(SecAggError, match=r"outside its neighbourhood: \[4\]"):
        site.share_keys({1: site.public_keys(), 4: other.public_keys()})
    assert site.stage == "keys"


def test_a_site_signs_one_survivor_set_and_answers_unmasking_once_for_it():
    server, sites = started(NODES, SecAggParams(), 4)
    for node in (1, 2, 3):
        sites[node].mask(np.zeros(4, np.uint32), server.shares_for(node))
    with pytest.raises(SecAggError, match="inconsistent survivor set"):
        sites[1].sign_survivors([2, 3, 4])  # without itself
    with pytest.raises(SecAggError, match="only 2 neighbours survived"):
        sites[1].sign_survivors([1, 2])
    signatures = {node: sites[node].sign_survivors([1, 2, 3]) for node in (1, 2, 3)}
    with pytest.raises(SecAggError, match="in stage 'checked'"):
        sites[1].sign_survivors([1, 2, 3, 4])  # a second set, for another group of sites
    with pytest.raises(SecAggError, match=r"but it signed \[1, 2, 3\]"):
        sites[1].unmask([1, 2, 3, 4], signatures)
    revealed = sites[1].unmask([1, 2, 3], signatures)
    key, seed = 0, 1
    assert revealed == {n: sites[1].held[n][seed if n in (1, 2, 3) else key] for n in NODES}
    with pytest.raises(SecAggError, match="in stage 'done'"):
        sites[1].unmask([1, 2, 3], signatures)


def test_a_session_survives_its_round_trip_through_text():
    server, sites = started(NODES, SecAggParams(), 4)
    restored = SiteSession.from_state(sites[2].to_state(), sites[2].identity)
    assert restored == sites[2]
    assert restored.mask(np.zeros(4, np.uint32), server.shares_for(2)).shape == (4,)


def test_a_round_without_this_site_is_refused():
    with pytest.raises(SecAggError, match="site 9 is not among"):
        SiteSession.start(9, 1, [1, 2, 3], SecAggParams(), identities([9])[9])
    with pytest.raises(SecAggError, match="site 1: its secure-aggregation identity is for node 2"):
        SiteSession.start(1, 1, [1, 2, 3], SecAggParams(), identities([2])[2])
