"""FedBuff over Hydra-nets by hand, on the toy model of `toy_hydra`: each site's slices, its staleness
weight, the masked weighted mean and the buffer's scale."""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord
from helpers import FakeGrid, make_reply, sent_specs
from toy_hydra import DELTA_A, DELTA_B, SPEC_A, SPEC_B, START, toy_record, toy_scores

from hydrafl.strategies.fedbuff_hydra import FedBuffHydra, FedBuffHydraConfig
from hydrafl.strategies.planner import SitePlanner


def _planned() -> FedBuffHydra:
    """Planned on `toy_scores`: node 1 (small tier, 10 examples) trains SPEC_A, node 2 (untiered, 30) SPEC_B."""
    strategy = FedBuffHydra(
        FedBuffHydraConfig(buffer_size=2), planner=SitePlanner(untiered=(1.0, 0.5))
    )
    scores = toy_scores()
    queries = list(strategy.configure_query(1, toy_record(START), ConfigRecord(), FakeGrid([1, 2])))
    strategy.aggregate_query(1, [scores[query.metadata.dst_node_id] for query in queries])
    assert not list(
        strategy.configure_query(2, toy_record(START), ConfigRecord(), FakeGrid([1, 2]))
    )  # planned once
    return strategy


def test_masked_buffer_step_by_hand():
    strategy = _planned()
    messages = [
        strategy.train_message(node, toy_record(START), ConfigRecord({"model-version": 0}))
        for node in (1, 2)
    ]
    assert sent_specs(messages) == {1: SPEC_A, 2: SPEC_B}
    assert strategy.reply_shapes(1, toy_record(START)) == {"w": (2, 2), "o": (2,)}
    # A fresh, weight 10/10 = 1; B three versions stale, weight 30/20 x 1/sqrt(4) = 0.75; scale (1 + 0.75) / 2
    strategy.add(make_reply(DELTA_A, 10, node_id=1), 0)
    strategy.add(make_reply(DELTA_B, 30, node_id=2), 3)
    new, _, report = strategy.step(toy_record(START))
    assert report.weights == [1.0, 0.75] and report.scale == 0.875
    w = {name: array.numpy() for name, array in new.items()}
    both = lambda a, b: (1.0 * a + 0.75 * b) / 1.75 * 0.875  # noqa: E731  (a coordinate both sites trained)
    expected_w = START["w"] - np.array(
        [
            [0.875 * 0.1, 0.875 * 0.2],  # only A
            [both(0.4, 0.8), both(0.4, 0.0)],  # 0.5, 0.2
            [0.875 * 0.3, -0.875 * 0.3],  # only B
            [0.0, 0.0],  # nobody
        ]
    )
    np.testing.assert_allclose(w["w"], expected_w, rtol=1e-6)
    np.testing.assert_allclose(w["w"][1], [3.0 - 0.5, 4.0 - 0.2], rtol=1e-6)
    np.testing.assert_allclose(w["v"], START["v"] - 0.875 * DELTA_B["v"], rtol=1e-6)
    np.testing.assert_allclose(
        w["o"], START["o"] - np.array([both(1.0, -1.0), both(0.0, 2.0)]), rtol=1e-6
    )


def test_a_site_that_missed_the_planning_round_gets_no_message():
    assert _planned().train_message(3, toy_record(START), ConfigRecord()) is None
