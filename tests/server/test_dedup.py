"""The coordinator's deduplication: planted cross-site duplicates found, one copy kept by the rule, and what the
coordinator receives in the exchange with real sites (the hydrafl ClientApp on the in-process grid): keyed
signatures, no record and no unkeyed hash; a site without the consortium's key, or with another, stops it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasketch import MinHash
from flwr.common.serde import message_to_proto
from helpers import SMALL_RUN

from hydrafl.client.dedup import record_tokens, site_signatures
from hydrafl.client.site_app import client_app, run_cohort, site_data
from hydrafl.data import load_cohort
from hydrafl.server.dedup import (
    NUM_PERM,
    DedupError,
    deduplicate_sites,
    duplicate_pairs,
    records_to_drop,
)
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid, simulated_dedup_key

KEY = bytes(range(32))
RUN = SMALL_RUN.replace(samples_per_site=80, duplicates=0.25, dedup=True)


@pytest.mark.parametrize("task", ["clinical-text", "tabular"])
def test_planted_duplicates_are_found_with_high_recall_and_precision(task):
    cohort = load_cohort(task, num_sites=4, samples_per_site=150, seed=3, duplicates=0.2)
    signatures = {
        FIRST_NODE_ID + i: site_signatures(site, cohort.task.modality, KEY, NUM_PERM)
        for i, site in enumerate(cohort.sites)
    }
    found = {
        frozenset({(a - FIRST_NODE_ID, row_a), (b - FIRST_NODE_ID, row_b)})
        for (a, row_a), (b, row_b) in duplicate_pairs(signatures, 0.8)
    }
    planted = {frozenset({(s, row), (c, copy)}) for s, row, c, copy in cohort.planted}
    assert len(planted & found) / len(planted) >= 0.95  # recall
    assert len(planted & found) / len(found) >= 0.95  # precision


def test_rows_shared_by_two_sites_files_are_found_though_each_site_standardises_its_own(tmp_path):
    rng = np.random.default_rng(1)
    shared = rng.normal(size=(15, 4)).round(3)
    cohorts = []
    for site in range(2):
        own = rng.normal(loc=site, size=(45, 4)).round(3)  # another mean and spread at each site
        rows = np.concatenate([shared, own])[rng.permutation(60)]
        path = tmp_path / f"site{site}.csv"
        lines = ["a,b,c,d,label"] + [
            ",".join(map(str, row)) + f",{i % 2}" for i, row in enumerate(rows)
        ]
        path.write_text("\n".join(lines) + "\n")
        cohorts.append(
            load_cohort(
                "",
                num_sites=1,
                partition="iid",
                data_path=path,
                label_column="label",
                samples_per_site=2,
            )
        )
    splits = [cohort.sites[0] for cohort in cohorts]
    truth = {
        ((0, i), (1, j))
        for i, a in enumerate(splits[0].train_records)
        for j, b in enumerate(splits[1].train_records)
        if torch.equal(a, b)
    }
    assert len(truth) >= 5
    (i, j) = next(iter(truth))[0][1], next(iter(truth))[1][1]
    assert not torch.equal(splits[0].train_x[i], splits[1].train_x[j])  # standardised apart
    signatures = {
        node: site_signatures(split, "tabular", KEY, NUM_PERM) for node, split in enumerate(splits)
    }
    assert set(duplicate_pairs(signatures, 0.8)) == truth


def test_each_group_of_copies_keeps_one_record_at_the_site_with_the_fewest_records():
    rng = np.random.default_rng(0)
    signatures = {
        node: rng.integers(0, 2**32, size=(rows, 64), dtype=np.uint32)
        for node, rows in ((7, 10), (5, 10), (3, 20))
    }
    shared = rng.integers(0, 2**32, size=64, dtype=np.uint32)
    signatures[7][4] = signatures[5][6] = signatures[3][0] = shared  # one patient at three sites
    signatures[3][9] = signatures[7][2]  # one at two sites
    near = signatures[7][2].copy()
    near[:5] = 1  # 59 of 64 permutations agree: 0.92
    signatures[5][1] = near
    drops = records_to_drop(signatures, 0.8)
    # ties on size (5 and 7 both hold 10) go to the lower node id; a group linked by near copies keeps one
    assert {node: rows.tolist() for node, rows in drops.items()} == {7: [2, 4], 5: [], 3: [0, 9]}
    assert duplicate_pairs(signatures, 0.95) == [
        ((3, 0), (5, 6)),
        ((3, 0), (7, 4)),
        ((3, 9), (7, 2)),
        ((5, 6), (7, 4)),
    ]


class RecordingGrid(InProcessGrid):
    """The in-process grid, keeping the bytes of every reply the coordinator receives."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: list[bytes] = []

    def send_and_receive(self, messages, *, timeout=None):
        for reply in super().send_and_receive(messages, timeout=timeout):
            self.received.append(message_to_proto(reply).SerializeToString())
            yield reply


def test_the_exchange_drops_the_copies_and_the_coordinator_receives_no_record_nor_unkeyed_hash():
    cohort = run_cohort(RUN)
    with RecordingGrid(client_app, RUN.sites, RUN.to_flower()) as grid:
        outcome = deduplicate_sites(grid, RUN.dedup_threshold)
        trained = [len(site_data(RUN, grid.contexts[node])[1].train_y) for node in sorted(outcome)]
    records = [len(site.train_y) for site in cohort.sites]
    assert [site.records for site in outcome.values()] == records
    dropped = [site.dropped for site in outcome.values()]
    assert dropped[1:] == [0, 0] and 0.95 * len(cohort.planted) <= dropped[0] <= len(cohort.planted)
    assert trained == [
        n - d for n, d in zip(records, dropped, strict=True)
    ]  # what training now sees

    received = b"".join(grid.received)
    recorded = [row for site in cohort.sites for row in site.train_records]  # what the sites hash
    tokens = {token for row in recorded for token in record_tokens(row, "tabular")}
    assert len(tokens) > 1000 and not any(token in received for token in tokens)
    assert not any(row.numpy().tobytes() in received for row in recorded)
    assert not any(
        row.numpy().tobytes() in received for site in cohort.sites for row in site.train_x
    )
    keyed = site_signatures(
        cohort.sites[1], "tabular", bytes.fromhex(simulated_dedup_key(RUN.seed)), NUM_PERM
    )
    assert all(signature.tobytes() in received for signature in keyed)  # what did arrive
    unkeyed = []
    for row in cohort.sites[1].train_records:
        sketch = MinHash(NUM_PERM, seed=1, scheme="affine32")
        sketch.update_batch(record_tokens(row, "tabular"))
        unkeyed.append(sketch.hashvalues.tobytes())
    assert not any(signature in received for signature in unkeyed)


def test_a_site_without_the_key_stops_the_dedup_step_with_its_reason():
    with InProcessGrid(client_app, RUN.sites, RUN.to_flower()) as grid:
        del grid.contexts[FIRST_NODE_ID + 1].node_config["dedup-key"]
        with pytest.raises(
            DedupError, match=f"site {FIRST_NODE_ID + 1}: this site holds no consortium"
        ):
            deduplicate_sites(grid, 0.8)
        assert not any("dedup" in context.state for context in grid.contexts.values())


def test_a_site_with_another_key_stops_the_dedup_step():
    with InProcessGrid(client_app, RUN.sites, RUN.to_flower()) as grid:
        grid.contexts[FIRST_NODE_ID + 2].node_config["dedup-key"] = "ab" * 32
        with pytest.raises(
            DedupError, match=f"site\\(s\\) {FIRST_NODE_ID + 2} hold a dedup key other"
        ):
            deduplicate_sites(grid, 0.8)
