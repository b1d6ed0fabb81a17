"""Screening of a round's updates before aggregation, whatever the strategy: a reply whose update norm is far
above the round's median, or whose direction is far from the mean of the others, is rejected with its reason.

Both tests need the whole round (its median norm, its mean direction), so with screening on the driver holds
every valid reply of the round before aggregating (O(sites x model) memory instead of streaming them).

- Norm: the L2 norm of everything the reply carries; rejected above `norm_factor` x the median of the round's
  norms (a site that trains a smaller subnetwork has a smaller norm: the test only cuts from above).
- Cosine: computed over the replies the norm test kept, each against the mean of the others (leave-one-out).
  Against a mean that includes the reply itself, a sign-flipped update passes: its own share of the mean
  outweighs the others' when honest updates are nearly orthogonal (as they are over many coordinates), so its
  cosine stays positive. Subnetwork strategies (Hydra, the width baselines, the LoRA baselines' ranks) send
  compact slices whose shapes differ by site, so the others' mean is taken per (array name, shape) over the
  other replies carrying an array of that name and shape, and a reply's cosine is
  sum <x_a, mean_a> / (||x restricted to those arrays|| ||mean restricted to them||) over its arrays that some
  other reply also carries; a reply that shares none has no cosine (only the norm test judges it). Two sites
  that trained different slices of the same size are compared position by position: screening judges the
  update's direction, not which coordinates it covers. Rejected below `min_cosine`.

A grid that keeps an audit trail (the coordinator's) implements `AuditsRejections` and is told of each one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from flwr.app import ArrayRecord, Message

from hydrafl.arrays import array_view
from hydrafl.updates import records

Update = Mapping[str, np.ndarray]
"""A site's update: its delta arrays by name (compact slices for subnetwork strategies)."""


@runtime_checkable
class AuditsRejections(Protocol):
    """A grid that records why a site's reply was rejected (the coordinator's audit trail)."""

    def record_rejection(self, node_id: int, server_round: int, reason: str) -> None:
        """Remember that `node_id`'s reply in `server_round` was rejected, and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Screening:
    """The run's `screen_norm` and `screen_cosine` (checked by `RunConfig`); either may be off."""

    norm_factor: float = 0.0
    """Reject an update whose norm is above this many times the round's median; 0 = off."""
    min_cosine: float = -1.0
    """Reject an update whose cosine to the mean of the round's other updates is below this; -1 = off."""

    @property
    def enabled(self) -> bool:
        return self.norm_factor > 0 or self.min_cosine > -1

    def reasons(self, updates: Mapping[int, Update]) -> dict[int, str]:
        """Per rejected node: why. Needs at least two updates for a median or a mean to mean anything."""
        if len(updates) < 2:
            return {}
        rejected: dict[int, str] = {}
        if self.norm_factor > 0:
            norms = {node: update_norm(update) for node, update in updates.items()}
            limit = self.norm_factor * statistics.median(norms.values())
            for node, norm in norms.items():
                if norm > limit:
                    rejected[node] = (
                        f"update norm {norm:.4g} above {self.norm_factor:g} x the round's median ({limit:.4g})"
                    )
        if self.min_cosine > -1:
            kept = {node: update for node, update in updates.items() if node not in rejected}
            for node, cosine in cosines_to_mean(kept).items():
                if cosine < self.min_cosine:
                    rejected[node] = (
                        f"cosine {cosine:.3f} to the others' mean update, below {self.min_cosine:g}"
                    )
        return rejected


def update_norm(update: Update) -> float:
    return math.sqrt(
        sum(float(np.square(array, dtype=np.float64).sum()) for array in update.values())
    )


def cosines_to_mean(updates: Mapping[int, Update]) -> dict[int, float]:
    """Each update's cosine to the mean of the other updates, taken per (name, shape) (see the module
    docstring); an update or a mean of norm 0 has cosine 0, and an update sharing no array with another has
    none."""
    sums: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
    counts: dict[tuple[str, tuple[int, ...]], int] = {}
    for update in updates.values():
        for name, array in update.items():
            key = (name, tuple(array.shape))
            sums[key] = sums.get(key, 0.0) + np.asarray(array, dtype=np.float64)
            counts[key] = counts.get(key, 0) + 1
    cosines = {}
    for node, update in updates.items():
        dot = own = mean_sq = 0.0
        shared = False
        for name, array in update.items():
            key = (name, tuple(array.shape))
            if counts[key] < 2:
                continue
            values = np.asarray(array, dtype=np.float64)
            others = (sums[key] - values) / (counts[key] - 1)
            dot += float(np.vdot(values, others))
            own += float(np.vdot(values, values))
            mean_sq += float(np.vdot(others, others))
            shared = True
        if shared:
            cosines[node] = dot / math.sqrt(own * mean_sq) if own > 0 and mean_sq > 0 else 0.0
    return cosines


def screen_replies(
    screening: Screening, replies: Iterable[Message]
) -> tuple[list[Message], dict[int, str]]:
    """The replies `screening` keeps, in node order, and why each other node's was rejected. All of the round's
    replies are held first: its median norm and mean direction need them all."""
    replies = sorted(replies, key=lambda reply: reply.metadata.src_node_id)
    updates = {
        reply.metadata.src_node_id: {
            name: array_view(a) for name, a in records(reply.content, ArrayRecord)[0].items()
        }
        for reply in replies
    }
    rejected = screening.reasons(updates)
    return [reply for reply in replies if reply.metadata.src_node_id not in rejected], rejected
