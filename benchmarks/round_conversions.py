"""Whole-model conversions the coordinator makes per training round: decodes and encodes, in model sizes.

    python -m hydrafl.benchmarks.round_conversions [--sites N]

A decode is `Array.numpy()` (a copy of an array out of its serialised bytes); an encode is
`Array.from_numpy_ndarray` (every `Array(ndarray)` or `Array(tensor)` ends there). Both are counted in bytes and
divided by the model's, so "3" is three whole models' worth, however the work was split over arrays. Views
that copy nothing (`hydrafl.arrays.array_view`) are not decodes, nor is handing over values already in memory
(`server.aggregation.flower_adapter.HeldArray`).

Only the coordinator is counted: the in-process grid runs each site inside its `send_and_receive`, and the
count pauses while a reply is produced. A run of 2 rounds of the real hydrafl app (3 tabular sites); round 2 is
reported, between the ends of round 1 and round 2 (training, aggregation, evaluation).

Measured, 3 sites: before the round pipeline FedAvg 12 decodes and 4 encodes, DiLoCo 4 and 1; after it 4 and
1 for both; with the reply check reading views, 1 and 1 for both (`tests/benchmarks/test_round_conversions.py`
holds them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from flwr.app import Array

from hydrafl.arrays import record_nbytes
from hydrafl.client.site_app import client_app
from hydrafl.config import RunConfig
from hydrafl.rounds import RoundRecord
from hydrafl.server.server_app import run_federation
from hydrafl.simulation.grid import InProcessGrid

STRATEGIES = ("fedavg", "diloco")


@dataclass(slots=True)
class Counts:
    """Bytes the coordinator decoded and encoded so far; `paused` while a site runs."""

    decoded: int = 0
    encoded: int = 0
    paused: bool = False


@contextmanager
def counting(counts: Counts) -> Iterator[None]:
    """Count every decode and encode of an Array in this process into `counts` (unless paused)."""
    numpy, from_numpy = Array.numpy, Array.__dict__["from_numpy_ndarray"].__func__

    def counted_numpy(self: Array):
        if not counts.paused:
            counts.decoded += len(self.data)
        return numpy(self)

    def counted_from_numpy(cls: type[Array], ndarray) -> Array:
        array = from_numpy(cls, ndarray)
        if not counts.paused:
            counts.encoded += len(array.data)
        return array

    Array.numpy = counted_numpy  # type: ignore[method-assign]
    Array.from_numpy_ndarray = classmethod(counted_from_numpy)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Array.numpy = numpy  # type: ignore[method-assign]
        Array.from_numpy_ndarray = classmethod(from_numpy)  # type: ignore[method-assign,assignment]


class SitesUncounted(InProcessGrid):
    """The in-process grid, pausing the count while a site produces its reply."""

    counts: Counts

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        while True:
            self.counts.paused = True
            try:
                reply = next(replies, None)
            finally:
                self.counts.paused = False
            if reply is None:
                return
            yield reply


def round_conversions(strategy: str, sites: int = 3) -> dict[str, float]:
    """Decodes and encodes (in model sizes) the coordinator made in round 2 of a 2-round run of `strategy`."""
    cfg = RunConfig.build(
        task="tabular",
        strategy=strategy,
        sites=sites,
        samples_per_site=60,
        rounds=2,
        local_steps=3,
        batch_size=16,
        lr=3e-3,
    )
    counts = Counts()
    at_round_end: list[tuple[int, int]] = []

    def on_round(record: RoundRecord) -> None:
        at_round_end.append((counts.decoded, counts.encoded))

    grid = SitesUncounted(client_app, cfg.sites, cfg.to_flower())
    grid.counts = counts
    with counting(counts):
        result = run_federation(grid, cfg, on_round=on_round)
    model_bytes = record_nbytes(result.arrays)
    (decoded_1, encoded_1), (decoded_2, encoded_2) = at_round_end[-2:]
    return {
        "decodes": round((decoded_2 - decoded_1) / model_bytes, 2),
        "encodes": round((encoded_2 - encoded_1) / model_bytes, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", type=int, default=3)
    args = parser.parse_args()
    table = {strategy: round_conversions(strategy, args.sites) for strategy in STRATEGIES}
    print(json.dumps({"sites": args.sites, "per_round": table}, indent=1))


if __name__ == "__main__":
    main()
