"""Whole-model decodes and encodes the coordinator makes per training round (`benchmarks/round_conversions.py`,
3 tabular sites, round 2), held where the round pipeline brought them.

Before it, Flower's FedAvg cost 12 decodes and 4 encodes a round: the reply check's decode of each delta (3),
then per reply the start and the delta decoded again and the site's end weights encoded (6 and 3), and Flower
decoding those weights (3) before encoding its average (1). Now the start is decoded once a round and the
weights reach Flower in memory (`flower_adapter.HeldArray`), and the reply check reads each delta as a view
of its bytes (`arrays.array_view`, no copy): the start's 1 decode, Flower's 1 encode. DiLoCo (deltas,
streamed) made 4 and 1 before the views, 1 and 1 now.
"""

from __future__ import annotations

import pytest

from hydrafl.benchmarks.round_conversions import round_conversions


@pytest.mark.parametrize(
    ("strategy", "decodes", "encodes"), [("fedavg", 1.0, 1.0), ("diloco", 1.0, 1.0)]
)
def test_a_round_decodes_and_encodes_only_what_its_aggregation_needs(strategy, decodes, encodes):
    assert round_conversions(strategy) == {"decodes": decodes, "encodes": encodes}
