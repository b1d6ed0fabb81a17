"""A coordinator that lies (Bonawitz et al., CCS 2017, active adversary), played against the real state
machines: it substitutes keys, tells sites different survivor sets, asks for a threshold at half the sites, and
sites reveal crafted shares. Each attack ends in a refusal that reveals or applies nothing, or in the right sum."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import numpy as np
import pytest
from secagg_rounds import checked, identities, masked, sessions, updates

from hydrafl.config import RunConfig
from hydrafl.secagg import SecAggError, SecAggParams, SiteSession, decode_sum, quantisation_bound
from hydrafl.secagg.crypto import new_private_key, public_key
from hydrafl.secagg.identity import new_signing_key
from hydrafl.secagg.shamir import split
from hydrafl.validation import ConfigError

NODES = [1, 2, 3, 4, 5]


def plain(data, nodes):
    return sum(data[n][1] for n in nodes), sum(data[n][1] * data[n][0] for n in nodes)


def test_a_key_the_coordinator_swapped_in_is_refused_before_any_share_is_made():
    sites = sessions(NODES, SecAggParams())
    keys = {node: site.public_keys() for node, site in sites.items()}
    own = public_key(new_private_key())
    swapped = {
        **keys,
        2: replace(keys[2], share_key=own, mask_key=own),
    }  # site 2's signature, the coordinator's keys
    with pytest.raises(
        SecAggError, match="the round keys of site 2: the signature does not verify"
    ):
        sites[1].share_keys(swapped)
    impostor = sessions(NODES, SecAggParams())[
        2
    ].public_keys()  # signed, but certified by another consortium
    with pytest.raises(SecAggError, match="site 2's certificate: the signature does not verify"):
        sites[1].share_keys({**keys, 2: impostor})
    stolen = replace(keys[3], share_key=keys[2].share_key)  # site 2's key under site 3's name
    with pytest.raises(SecAggError, match="round keys of site 3"):
        sites[1].share_keys({**keys, 3: stolen})
    assert (
        sites[1].stage == "keys" and sites[1].held == {}
    )  # nothing shared: the round cannot go on for it
    assert len(sites[1].share_keys(keys)) == 4  # the honest routing still works


def test_keys_signed_for_another_setup_are_refused():
    """A coordinator telling sites different participant lists (so different thresholds) gets keys each
    signed for its own setup, which no other site accepts."""
    consortium = new_signing_key()
    ids = identities(NODES + [6], consortium)
    five = {n: SiteSession.start(n, 1, NODES, SecAggParams(), ids[n]) for n in NODES}
    six = SiteSession.start(2, 1, NODES + [6], SecAggParams(), ids[2])
    keys = {n: s.public_keys() for n, s in five.items()}
    with pytest.raises(SecAggError, match="the round keys of site 2"):
        five[1].share_keys({**keys, 2: six.public_keys()})


def test_two_survivor_sets_to_two_groups_unmask_no_one():
    """The classic unmasking attack: tell sites 1-3 that everyone survived and sites 3-5 that site 1 dropped,
    to collect both site 1's self-mask seed and its pairwise key. Site 3 signs only once; sites 4 and 5 then
    hold fewer than a threshold of signatures for their set and reveal nothing."""
    data = updates(NODES, 50)
    _, sites = masked(data, SecAggParams())
    everyone, without_one = [1, 2, 3, 4, 5], [2, 3, 4, 5]
    first = {n: sites[n].sign_survivors(everyone) for n in (1, 2, 3)}
    with pytest.raises(SecAggError, match="in stage 'checked'"):
        sites[3].sign_survivors(without_one)
    second = {n: sites[n].sign_survivors(without_one) for n in (4, 5)}
    with pytest.raises(SecAggError, match="only 2 neighbours signed the survivor set"):
        sites[4].unmask(without_one, second)
    with pytest.raises(SecAggError, match="site 3's survivor set: the signature does not verify"):
        sites[4].unmask(
            without_one, {**second, 3: first[3]}
        )  # site 3's signature is over the other set
    with pytest.raises(SecAggError, match="but it signed"):
        sites[5].unmask(
            everyone, first
        )  # the first group's signatures, to a site that signed the second set
    assert sites[4].stage == sites[5].stage == "checked"  # no key share of site 1 left either site
    revealed = sites[2].unmask(everyone, first)
    key, seed = 0, 1
    assert revealed[1] == sites[2].held[1][seed] != sites[2].held[1][key]


def test_a_survivor_set_forged_by_the_coordinator_is_refused():
    server, sites = masked(updates(NODES, 50), SecAggParams())
    checked(server, sites)
    survivors, signatures = server.unmask_request()
    forged = {**signatures, 2: bytes(64)}
    with pytest.raises(SecAggError, match="site 2's survivor set: the signature does not verify"):
        sites[1].unmask(survivors, forged)
    with pytest.raises(SecAggError, match="outside the survivors"):
        sites[1].unmask(
            survivors, {n: s for n, s in signatures.items() if n != 1}
        )  # its own must be there
    assert sites[1].stage == "checked"


@pytest.mark.parametrize("threshold", [2, 3])
def test_a_threshold_at_or_below_half_the_sites_is_refused_everywhere(threshold):
    """4 sites: a threshold of 2 would let two disjoint pairs rebuild the two secrets of one site."""
    params = SecAggParams(reconstruction_threshold=threshold)
    if threshold == 2:
        with pytest.raises(SecAggError, match="must be above half the 4 shares"):
            params.check_round(4)
        with pytest.raises(
            SecAggError, match="above half"
        ):  # a site checks what the coordinator sent
            SiteSession.start(1, 1, [1, 2, 3, 4], params, identities([1])[1])
        with pytest.raises(
            ConfigError, match="invalid --secagg-threshold=2: expected 0 .* or 3..4"
        ):
            RunConfig(sites=4, secagg=True, secagg_threshold=2)
    else:
        params.check_round(4)
        assert RunConfig(sites=4, secagg=True, secagg_threshold=3).secagg_threshold == 3


def _crafted(
    sites: dict[int, SiteSession], liar: int, owner: int, survivors, signatures
) -> dict[int, bytes]:
    """`liar`'s unmasking reply with its share of `owner`'s secret replaced by an in-range share of another one."""
    revealed = sites[liar].unmask(survivors, signatures)
    x = sorted(sites).index(liar) + 1
    return {**revealed, owner: split(os.urandom(32), [x, x + 1], 2)[x]}


@pytest.mark.parametrize(
    "owner", [2, 5]
)  # a survivor's self-mask seed; the pairwise key of a site that dropped
def test_a_crafted_share_at_exactly_the_threshold_halts_the_round(owner):
    server, sites = masked(updates(NODES, 50), SecAggParams(), drop_before_upload=(5,))
    checked(server, sites)
    survivors, signatures = server.unmask_request()
    server.receive_unmask(1, _crafted(sites, 1, owner, survivors, signatures))
    for node in (2, 3):  # sites 4 stays silent: exactly 3 shares of every secret
        server.receive_unmask(node, sites[node].unmask(survivors, signatures))
    with pytest.raises(
        SecAggError,
        match=f"site {owner}'s secret: no 3 of the 3 shares .* halts and applies nothing",
    ):
        server.result()


@pytest.mark.parametrize("owner", [2, 5])
def test_a_crafted_share_with_a_spare_is_outvoted_and_its_sender_named(owner, caplog):
    data = updates(NODES, 500)
    server, sites = masked(data, SecAggParams(), drop_before_upload=(5,))
    checked(server, sites)
    survivors, signatures = server.unmask_request()
    server.receive_unmask(3, _crafted(sites, 3, owner, survivors, signatures))
    for node in (1, 2, 4):
        server.receive_unmask(node, sites[node].unmask(survivors, signatures))
    with caplog.at_level(logging.WARNING):
        total, count = server.result()
    assert (
        server.culprits == {3}
        and f"site 3 revealed a corrupt share of site {owner}'s secret" in caplog.text
    )
    weights, summed = decode_sum(total, count, SecAggParams(), per_coordinate=False)
    assert weights.tolist() == [plain(data, [1, 2, 3, 4])[0]]
    assert np.abs(summed - plain(data, [1, 2, 3, 4])[1]).max() <= quantisation_bound(
        4, SecAggParams()
    )


def test_a_survivor_that_signs_badly_or_not_at_all_is_left_out_of_unmasking_and_the_round_goes_on():
    data = updates(NODES, 200)
    server, sites = masked(data, SecAggParams())
    checked(server, sites, silent=(2, 3))
    with pytest.raises(SecAggError, match="site 3's survivor set: the signature does not verify"):
        server.receive_signature(
            3, bytes(64)
        )  # checked by the coordinator too: its peers need not refuse
    survivors, signatures = server.unmask_request()
    assert survivors == NODES and sorted(signatures) == [1, 4, 5]
    with pytest.raises(SecAggError, match="out of turn"):
        server.receive_unmask(2, {})
    for node in signatures:
        server.receive_unmask(node, sites[node].unmask(survivors, signatures))
    weights, _ = decode_sum(*server.result(), SecAggParams(), per_coordinate=False)
    assert weights.tolist() == [
        plain(data, NODES)[0]
    ]  # sites 2 and 3 still count: they masked and survived


def test_survivor_signatures_from_a_rounds_training_do_not_count_in_its_evaluation():
    """A round runs two secure sums (train, then evaluate) with the same number and sites; the purpose is part
    of every signature, so survivor signatures collected in one cannot make a site of the other reveal."""
    data = updates(NODES, 20)
    _, train_sites = masked(data, SecAggParams())
    everyone = list(NODES)
    train_signed = {n: train_sites[n].sign_survivors(everyone) for n in NODES}
    _, evaluate_sites = masked(data, SecAggParams(purpose="evaluate"))
    evaluate_sites[1].sign_survivors(everyone)
    with pytest.raises(SecAggError, match="survivor set: the signature does not verify"):
        evaluate_sites[1].unmask(everyone, train_signed)
    assert evaluate_sites[1].stage == "checked"
