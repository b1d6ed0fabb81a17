"""Deduplication in the simulation: the sites train on the records left after the exchange (another data hash
at the site that dropped copies, the same elsewhere), and forked workers keep each site's drop list as one
process does."""

from __future__ import annotations

from helpers import SMALL_RUN

from hydrafl.server.dedup import SiteDedup
from hydrafl.simulation.compare import run_strategy
from hydrafl.simulation.grid import FIRST_NODE_ID

RUN = SMALL_RUN.replace(rounds=2, samples_per_site=80, duplicates=0.25, dedup=True)


def test_sites_train_on_what_dedup_left_in_one_process_and_in_workers():
    outcomes: list[dict[int, SiteDedup]] = [{}, {}]
    one = run_strategy(RUN, "inprocess", on_dedup=outcomes[0].update)
    forked = run_strategy(RUN, "inprocess", on_dedup=outcomes[1].update, workers=2)
    undeduplicated = run_strategy(RUN.replace(dedup=False), "inprocess")
    assert outcomes[0] == outcomes[1] and outcomes[0][FIRST_NODE_ID].dropped > 0
    for a, b, c in zip(one[1:], forked[1:], undeduplicated[1:], strict=True):
        assert a["data_hash_per_site"] == b["data_hash_per_site"]
        hashes, plain = a["data_hash_per_site"], c["data_hash_per_site"]
        assert (
            hashes[str(FIRST_NODE_ID)] != plain[str(FIRST_NODE_ID)]
        )  # site 0 trains without its copies
        assert all(hashes[node] == plain[node] for node in hashes if node != str(FIRST_NODE_ID))
    assert one[-1]["loss"] == forked[-1]["loss"]
