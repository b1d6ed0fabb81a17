"""The coordinator's state machine refuses what a site should not send, and changes nothing when it does."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
from secagg_rounds import checked, sessions, started

from hydrafl.secagg import SecAggError, SecAggParams, ServerSession

NODES = [1, 2, 3, 4, 5]


def snapshot(server: ServerSession) -> dict:
    return copy.deepcopy({k: v for k, v in vars(server).items() if k != "total"})


def test_keys_from_a_site_not_in_the_round_or_malformed_are_refused():
    server = ServerSession.start(1, NODES, SecAggParams(), 10)
    keys = sessions([9, 1, 2], SecAggParams())[9].public_keys()
    with pytest.raises(SecAggError, match="site 9 is not in round 1"):
        server.receive_keys(9, keys)
    with pytest.raises(SecAggError, match="malformed key material"):
        server.receive_keys(1, replace(keys, mask_key=keys.mask_key[:5]))
    assert server.keys == {}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda sealed: {**sealed, 6: sealed[2]},
            "addressed to",
        ),  # a share for a site outside the round
        (
            lambda sealed: {k: v for k, v in sealed.items() if k != 2},
            "addressed to",
        ),  # one neighbour left out
        (lambda sealed: {**sealed, 2: sealed[2][:-1]}, "must be 176 bytes"),
    ],
)
def test_a_malformed_share_or_one_for_another_site_changes_nothing(edit, message):
    params = SecAggParams()
    sites = sessions(NODES, params)
    server = ServerSession.start(1, NODES, params, 10)
    for node, site in sites.items():
        server.receive_keys(node, site.public_keys())
    sealed = sites[1].share_keys(server.keys_for(1))
    before = snapshot(server)
    with pytest.raises(SecAggError, match=message):
        server.receive_shares(1, edit(sealed))
    assert snapshot(server) == before
    server.receive_shares(1, sealed)  # the honest message is still accepted


def test_a_masked_vector_of_the_wrong_shape_or_out_of_turn_is_refused():
    server, sites = started(NODES, SecAggParams(), 10)
    with pytest.raises(SecAggError, match="out of turn"):
        server.receive_masked(1, np.zeros(10, np.uint32))  # its shares were never routed to it
    server.shares_for(1)
    for bad in (np.zeros(9, np.uint32), np.zeros(10, np.int64)):
        with pytest.raises(SecAggError, match=r"uint32 of shape \(10,\)"):
            server.receive_masked(1, bad)
    assert not server.total.read(0, 10).any() and server.masked == set()


def test_revealed_shares_must_be_exactly_those_expected():
    server, sites = started(NODES, SecAggParams(), 4)
    for node in NODES[:4]:
        server.receive_masked(
            node, sites[node].mask(np.zeros(4, np.uint32), server.shares_for(node))
        )
    checked(server, sites)
    survivors, signatures = server.unmask_request()
    revealed = sites[1].unmask(survivors, signatures)
    with pytest.raises(SecAggError, match="expected exactly"):
        server.receive_unmask(1, {k: v for k, v in revealed.items() if k != 5})
    with pytest.raises(SecAggError, match="66 bytes"):
        server.receive_unmask(1, {**revealed, 5: b"short"})
    assert server.revealed == {}
