"""The aggregation benchmark's workload (lazily built site replies, the two aggregators) and its memory probe.

Run as a module, it measures one aggregator's peak memory alone in a fresh process: the parent's memory and
its earlier runs cannot leak into the number. The probe reads VmHWM (this process's own peak RSS) and not
`getrusage(...).ru_maxrss`: Linux carries a forked child's pre-exec high-water mark, i.e. the parent's RSS,
into ru_maxrss, so a child of a big benchmark process would report the parent's size.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.arrays import to_record
from hydrafl.protocol import WEIGHT
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator

ARRAYS_PER_MODEL = 10
FIRST_NODE_ID = 1001

Aggregate = Callable[[Iterable[Message]], ArrayRecord]


def num_examples(site: int) -> int:
    """Unequal weights, so a wrong weighting shows up in the equality check."""
    return 50 + 7 * site


def make_reply(site: int, params: int) -> Message:
    """Site `site`'s training reply: one ArrayRecord of ARRAYS_PER_MODEL float32 arrays, one MetricRecord."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    request = Message(RecordDict(), dst_node_id=FIRST_NODE_ID + site, message_type="train")
    request.metadata.__dict__["_message_id"] = f"request-{site}"
    rng = np.random.default_rng(site)
    size = params // ARRAYS_PER_MODEL
    arrays = ArrayRecord(
        {f"layer{i}": Array(rng.standard_normal(size, dtype=np.float32)) for i in range(ARRAYS_PER_MODEL)}
    )
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({WEIGHT: num_examples(site)})})
    return Message(content, reply_to=request)


def lazy_replies(sites: int, params: int) -> Iterator[Message]:
    """Replies built only when iterated, as they would arrive one by one: nothing forces them all resident."""
    for site in range(sites):
        yield make_reply(site, params)


def hydrafl_aggregate(replies: Iterable[Message]) -> ArrayRecord:
    """hydrafl's streaming weighted mean, returned as the ArrayRecord a strategy hands back (as DiLoCo does)."""
    accumulator = WeightedDeltaAccumulator()
    accumulator.add_all(replies)
    # the metric mean FedAvg also computes, so both aggregators do the same work
    aggregate_metricrecords(accumulator.metric_records, accumulator.weighted_by_key)
    return to_record(accumulator.mean())


def flower_aggregate(replies: Iterable[Message]) -> ArrayRecord:
    arrays, _ = FedAvg().aggregate_train(1, replies)
    if arrays is None:
        raise RuntimeError("Flower's FedAvg aggregated nothing")
    return arrays


AGGREGATORS: dict[str, Aggregate] = {"hydrafl": hydrafl_aggregate, "flower": flower_aggregate}


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (the memory probe needs Linux)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=("baseline", *AGGREGATORS), help="baseline: imports and one reply only")
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--params", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "baseline":
        make_reply(0, args.params)
    else:
        AGGREGATORS[args.what](lazy_replies(args.sites, args.params))
    print(json.dumps({"peak_bytes": peak_rss_bytes()}))

if __name__ == "__main__":
    main()
