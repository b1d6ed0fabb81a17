"""The aggregation benchmark's workload (lazily built site replies and masks, the aggregators) and its memory probe.

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
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.protocol import WEIGHT
from hydrafl.strategies.accumulator import MaskedDeltaAccumulator, WeightedDeltaAccumulator

ARRAYS_PER_MODEL = 10
FIRST_NODE_ID = 1001
MASKED_FRACTION = 0.75
"""The share of coordinates each site of the masked workload was assigned (a different random set per site)."""

Aggregate = Callable[[Iterable[Message]], object]


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
        {
            f"layer{i}": Array(rng.standard_normal(size, dtype=np.float32))
            for i in range(ARRAYS_PER_MODEL)
        }
    )
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({WEIGHT: num_examples(site)})})
    return Message(content, reply_to=request)


def make_masks(site: int, params: int) -> dict[str, torch.Tensor]:
    """The coordinates site `site` was assigned: MASKED_FRACTION of each array, at random (bool)."""
    rng = np.random.default_rng(10_000 + site)
    size = params // ARRAYS_PER_MODEL
    return {
        f"layer{i}": torch.from_numpy(rng.random(size, dtype=np.float32) < MASKED_FRACTION)
        for i in range(ARRAYS_PER_MODEL)
    }


def lazy_replies(sites: int, params: int) -> Iterator[Message]:
    """Replies built only when iterated, as they would arrive one by one: nothing forces them all resident."""
    for site in range(sites):
        yield make_reply(site, params)


def hydrafl_aggregate(
    replies: Iterable[Message], threads: int | None = None
) -> dict[str, torch.Tensor]:
    """The streaming weighted mean (as DiLoCo folds a round): a list is folded a group at a time, an iterator
    one reply at a time."""
    accumulator = WeightedDeltaAccumulator(threads=threads)
    accumulator.add_all(replies)
    return accumulator.mean()


def hydrafl_one_by_one(
    replies: Iterable[Message], threads: int | None = None
) -> dict[str, torch.Tensor]:
    """The same mean, each reply folded as it arrives (`add`), as a coordinator streaming replies does."""
    accumulator = WeightedDeltaAccumulator(threads=threads)
    for reply in replies:  # the benchmark passes a list: the replies are resident anyway
        accumulator.add(reply)
    return accumulator.mean()


def hydrafl_masked(
    replies: Iterable[Message],
    threads: int | None = None,
    masks: list[dict[str, torch.Tensor]] | None = None,
    *,
    params: int = 0,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The masked mean of subnetwork updates (`MaskedDeltaAccumulator.add`, as FedIT folds a round); masks are
    built as replies arrive when not given."""
    accumulator = MaskedDeltaAccumulator(threads=threads)
    arriving = iter(replies)
    site = 0
    # each reply is released (`del`) before the next one is read, as `add_all` does
    while (reply := next(arriving, None)) is not None:
        accumulator.add(reply, masks[site] if masks is not None else make_masks(site, params))
        del reply
        site += 1
    return accumulator.mean()


def flower_aggregate(replies: Iterable[Message], threads: int | None = None) -> ArrayRecord:
    arrays, _ = FedAvg().aggregate_train(1, replies)
    if arrays is None:
        raise RuntimeError("Flower's FedAvg aggregated nothing")
    return arrays


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (the memory probe needs Linux)")


PROBES = ("baseline", "hydrafl", "hydrafl masked", "flower")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "what", choices=PROBES, help="baseline: imports and one reply (and its masks) only"
    )
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--params", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    replies = lazy_replies(args.sites, args.params)
    if args.what == "baseline":  # both alive at once; the peak (VmHWM) remembers them once freed
        [make_reply(0, args.params), make_masks(0, args.params)]
    elif args.what == "hydrafl":
        hydrafl_aggregate(replies)
    elif args.what == "hydrafl masked":
        hydrafl_masked(replies, params=args.params)
    else:
        flower_aggregate(replies)
    print(json.dumps({"peak_bytes": peak_rss_bytes()}))


if __name__ == "__main__":
    main()
