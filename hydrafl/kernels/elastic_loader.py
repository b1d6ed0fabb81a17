"""Zephon-style elastic deterministic loading: the same global batches whatever the number of ranks.

The round's global sample order is a pure function of (seed, round): a seeded permutation `order` of the
dataset's indices. A round that needs more than one pass over the data reads further passes (`epoch` 1, 2, ...),
each its own permutation, a pure function of (seed, round, epoch); pass 0 is the round's order. Position g
of that order belongs to lane g mod L, for a fixed number of lanes L (at least the largest world size ever
used). Each global batch of G samples takes G / L consecutive items from every
lane, so global batch k is exactly order[k G : (k + 1) G], whoever reads it. Rank r of W owns the contiguous
lanes [r L/W, (r + 1) L/W) and emits their items round-robin; the W rank batches, interleaved lane block by
lane block (`assemble_global_batch`), give the global batch in canonical order.

A checkpoint is each lane's position in the round's order; merged over ranks (`merge_state_dicts`), it resumes
on any world size that divides L. The round's data hash is a SHA-256 over the ordered sample ids of every
global batch handed out so far: equal on every rank and every world size, so a coordinator can compare sites'
data streams, and a resumed run can prove it saw the same data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np


class LoaderConfigError(ValueError):
    """The loader's settings cannot produce world-size-independent global batches."""


class WorldSizeError(LoaderConfigError):
    """The world size (or rank) does not fit the fixed number of lanes."""


class LoaderCheckpointError(ValueError):
    """A checkpoint this loader cannot resume from."""


class LaneCountChangedError(LoaderCheckpointError):
    """The checkpoint was written with a different number of lanes: its positions mean different samples."""


class MissingLaneError(LoaderCheckpointError):
    """The checkpoint lacks some lanes' positions (e.g. one rank's state was not merged in)."""


def round_order(dataset_size: int, seed: int, server_round: int, epoch: int = 0) -> np.ndarray:
    """The global sample order [dataset_size] of a round's pass `epoch`: a permutation, a pure function of
    (seed, round, epoch)."""
    key = [seed, server_round] if epoch == 0 else [seed, server_round, epoch]
    return np.random.default_rng(key).permutation(dataset_size)


def hash_global_batches(batches: Iterable[Sequence[int]]) -> str:
    """SHA-256 hex over each global batch's length and ordered sample ids (little-endian int64)."""
    digest = hashlib.sha256()
    for batch in batches:
        ids = np.asarray(batch, dtype="<i8")
        digest.update(np.int64(ids.size).astype("<i8").tobytes())
        digest.update(ids.tobytes())
    return digest.hexdigest()


def assemble_global_batch(rank_batches: Sequence[Sequence[int]], lanes: int) -> list[int]:
    """The W rank batches of one step, in rank order, as the global batch in canonical order.

    A rank batch is [G/L items per lane, L/W lanes] row-major; side by side they make [G/L, L] row-major,
    which is the global order's positions k G ... (k + 1) G - 1.
    """
    lanes_per_rank = lanes // len(rank_batches)
    blocks = [
        np.asarray(batch).reshape(-1, lanes_per_rank) for batch in rank_batches
    ]  # W x [G/L, L/W]
    return np.concatenate(blocks, axis=1).reshape(-1).tolist()  # [G]


class ElasticLoader:
    """This rank's batches of sample ids for one round; iterate it, checkpoint it, hash the round.

    Iterating yields lists of G / world_size sample ids (index your dataset with them) until the round holds
    no further full global batch (the remainder, dataset_size mod G, is skipped so every rank sees equal
    batches); `start_round` begins the next round. The state counts batches handed out.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        global_batch_size: int,
        lanes: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        server_round: int = 0,
        epoch: int = 0,
    ) -> None:
        if lanes < 1:
            raise LoaderConfigError(
                f"lanes={lanes} must be >= 1 (at least the largest world size you will use)"
            )
        if world_size < 1 or world_size > lanes:
            raise WorldSizeError(
                f"world size {world_size} must be between 1 and the number of lanes {lanes}; "
                f"use at most {lanes} ranks, or a loader with more lanes (a fresh run: lanes fix the data order)"
            )
        if lanes % world_size:
            raise WorldSizeError(
                f"{lanes} lanes do not divide evenly over world size {world_size}; use a world size that "
                f"divides {lanes} ({', '.join(str(w) for w in range(1, lanes + 1) if lanes % w == 0)})"
            )
        if not 0 <= rank < world_size:
            raise WorldSizeError(
                f"rank {rank} is outside [0, {world_size}) for world size {world_size}"
            )
        if global_batch_size < 1 or global_batch_size % lanes:
            raise LoaderConfigError(
                f"global batch size {global_batch_size} must be a positive multiple of the {lanes} lanes, so every "
                "lane gives the same number of samples to each global batch"
            )
        if dataset_size < global_batch_size:
            raise LoaderConfigError(
                f"a dataset of {dataset_size} samples holds no full global batch of {global_batch_size}; "
                "lower global_batch_size"
            )
        if seed < 0:
            raise LoaderConfigError(f"seed {seed} must be >= 0")
        self.dataset_size, self.global_batch_size, self.lanes, self.seed = (
            dataset_size,
            global_batch_size,
            lanes,
            seed,
        )
        self.world_size, self.rank = world_size, rank
        self.per_lane = global_batch_size // lanes  # items each lane gives each global batch
        lanes_per_rank = lanes // world_size
        self.owned_lanes = range(rank * lanes_per_rank, (rank + 1) * lanes_per_rank)
        self.steps_per_round = dataset_size // global_batch_size
        """Full global batches in one pass over the data."""
        self.start_round(server_round, epoch)

    def start_round(self, server_round: int, epoch: int = 0) -> None:
        """Begin pass `epoch` of `server_round` from its first global batch."""
        if server_round < 0 or epoch < 0:
            raise LoaderConfigError(f"round {server_round} and epoch {epoch} must be >= 0")
        self.server_round, self.epoch = server_round, epoch
        self._order = round_order(
            self.dataset_size, self.seed, server_round, epoch
        )  # [dataset_size]
        self.lane_positions = dict.fromkeys(
            self.owned_lanes, 0
        )  # items handed out per lane, this round

    @property
    def step(self) -> int:
        """Global batches handed out so far this round (all lanes move in lockstep)."""
        return self.lane_positions[self.owned_lanes.start] // self.per_lane

    def __iter__(self) -> Iterator[list[int]]:
        while self.step < self.steps_per_round:
            batch = self.rank_batch(self.step)
            for lane in self.owned_lanes:
                self.lane_positions[lane] += self.per_lane
            yield batch

    def rank_batch(self, step: int) -> list[int]:
        """This rank's share of global batch `step`: lane items round-robin over the owned lanes."""
        items = np.arange(step * self.per_lane, (step + 1) * self.per_lane)[
            :, None
        ]  # [G/L, 1] per-lane index
        lanes = np.asarray(self.owned_lanes)[None, :]  # [1, L/W]
        return self._order[lanes + self.lanes * items].reshape(-1).tolist()  # [G/W]

    def global_batch(self, step: int) -> list[int]:
        """Global batch `step` of this round in canonical order: order[k G : (k + 1) G]."""
        return self._order[
            step * self.global_batch_size : (step + 1) * self.global_batch_size
        ].tolist()

    def round_hash(self) -> str:
        """SHA-256 hex of every global batch handed out this round; the same on every rank and world size."""
        return hash_global_batches(self.global_batch(step) for step in range(self.step))

    def state_dict(self) -> dict[str, Any]:
        """This rank's lanes' positions and the settings they are relative to; merge all ranks' to resume."""
        return {
            "dataset_size": self.dataset_size,
            "global_batch_size": self.global_batch_size,
            "lanes": self.lanes,
            "seed": self.seed,
            "server_round": self.server_round,
            "epoch": self.epoch,
            "lane_positions": dict(self.lane_positions),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a merged checkpoint (every lane's position), possibly written with another world size."""
        if state["lanes"] != self.lanes:
            raise LaneCountChangedError(
                f"the checkpoint has {state['lanes']} lanes, this loader {self.lanes}; lanes fix which samples "
                f"each position means, so resume with lanes={state['lanes']}"
            )
        for key in ("dataset_size", "global_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise LoaderCheckpointError(
                    f"the checkpoint's {key} is {state[key]}, this loader's {getattr(self, key)}; resume with "
                    f"{key}={state[key]}"
                )
        positions = {int(lane): int(position) for lane, position in state["lane_positions"].items()}
        missing = sorted(set(range(self.lanes)) - set(positions))
        if missing:
            raise MissingLaneError(
                f"the checkpoint lacks lanes {missing} of {self.lanes}; merge every rank's state_dict() with "
                "merge_state_dicts before resuming"
            )
        if len(set(positions.values())) != 1:
            raise LoaderCheckpointError(
                f"lane positions differ ({positions}); the ranks' states were saved at different steps, "
                "save them all after the same step"
            )
        self.start_round(state["server_round"], state.get("epoch", 0))
        for lane in self.owned_lanes:
            self.lane_positions[lane] = positions[lane]


def merge_state_dicts(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One checkpoint from every rank's `state_dict()`: the settings they share and the union of lane positions."""
    merged: dict[str, Any] = {}
    positions: dict[int, int] = {}
    for state in states:
        settings = {key: value for key, value in state.items() if key != "lane_positions"}
        for key, value in settings.items():
            if merged.setdefault(key, value) != value:
                cls = LaneCountChangedError if key == "lanes" else LoaderCheckpointError
                raise cls(
                    f"ranks disagree on {key}: {merged[key]} vs {value}; merge states from one run and round"
                )
        positions.update(
            {int(lane): int(position) for lane, position in state["lane_positions"].items()}
        )
    if not merged:
        raise LoaderCheckpointError("no states to merge; pass every rank's state_dict()")
    return {**merged, "lane_positions": positions}
