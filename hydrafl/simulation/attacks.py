"""Simulated Byzantine sites: a fixed, seeded subset of the in-process sites replaces its training updates.

The attacks are those of the robust-aggregation literature (as in epfml/byzantine-robust-noniid-optimizer), on
the deltas sites send (start - end, pseudo-gradients):

- signflip: the site's own delta, negated;
- scale: the site's own delta times `scale` (100);
- gaussian: a random update of N(0, `sigma`^2) coordinates (sigma 1);
- alie, "a little is enough" (Baruch et al., 2019): with n sites in the round of which m attack,
  s = floor(n/2 + 1) - m and z = Phi^-1((n - m - s) / (n - m)); every attacker sends mu - z sigma, mu and sigma
  the coordinate-wise mean and standard deviation (ddof 1) of the honest deltas;
- ipm, inner-product manipulation (Xie et al., 2020): every attacker sends -epsilon mu (epsilon 0.1).

The attackers are omniscient, as in those papers: alie and ipm use the honest deltas of the same round, so the
grid holds a round's training replies before yielding them. Subnetwork strategies send compact slices whose
shapes differ by site: the statistics are taken per (array name, shape) over the honest replies with an array
of that name and shape; an attacker's array that no honest reply shares stays as the site computed it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message
from flwr.clientapp import ClientApp
from flwr.common import MessageType

from hydrafl.config import ATTACKS
from hydrafl.simulation.grid import InProcessGrid

Update = dict[str, np.ndarray]


@dataclass(frozen=True, kw_only=True, slots=True)
class Attack:
    """What the attacking sites send, and how many of them there are."""

    name: str
    fraction: float
    seed: int = 0
    scale: float = 100.0
    sigma: float = 1.0
    ipm_epsilon: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack {self.name!r}; choose one of {', '.join(ATTACKS)}")
        if not 0 < self.fraction < 1:
            raise ValueError(f"the attackers' fraction must be in (0, 1), got {self.fraction}")

    def attackers(self, nodes: Iterable[int]) -> frozenset[int]:
        """round(fraction x sites) of `nodes`, a pure function of the seed."""
        nodes = sorted(nodes)
        return frozenset(random.Random(self.seed).sample(nodes, round(self.fraction * len(nodes))))

    def apply(
        self, updates: Mapping[int, Update], attackers: Iterable[int], server_round: int
    ) -> dict[int, Update]:
        """The attackers' replacement updates, from the round's `updates` (node -> delta arrays) of which
        `attackers` attack; the honest ones are what the others sent."""
        attackers = set(attackers) & set(updates)
        honest = [update for node, update in updates.items() if node not in attackers]
        stats = honest_statistics(honest)
        z = alie_z(len(updates), len(attackers)) if self.name == "alie" else 0.0
        out = {}
        for node in sorted(attackers):
            rng = np.random.default_rng([self.seed, server_round, node])
            out[node] = {
                name: self._forge(array, stats.get((name, array.shape)), z, rng)
                for name, array in updates[node].items()
            }
        return out

    def _forge(
        self,
        own: np.ndarray,
        stats: tuple[np.ndarray, np.ndarray] | None,
        z: float,
        rng: np.random.Generator,
    ) -> np.ndarray:
        if self.name == "signflip":
            return -own
        if self.name == "scale":
            return self.scale * own
        if self.name == "gaussian":
            return rng.normal(0.0, self.sigma, own.shape).astype(own.dtype)
        if stats is None:
            return own
        mean, std = stats
        forged = mean - z * std if self.name == "alie" else -self.ipm_epsilon * mean
        return forged.astype(own.dtype)


def alie_z(n: int, m: int) -> float:
    """ALIE's z for n sites of which m attack: the largest deviation that still hides among the honest ones."""
    s = math.floor(n / 2 + 1) - m
    p = (n - m - s) / (n - m)
    if not 0 < p < 1:
        raise ValueError(
            f"ALIE is undefined for {m} attackers of {n} sites (Phi^-1({p:g})); use fewer attackers"
        )
    return statistics.NormalDist().inv_cdf(p)


def honest_statistics(
    honest: Iterable[Update],
) -> dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]]:
    """Per (name, shape): the coordinate-wise mean and standard deviation (ddof 1; 0 for one reply) of the
    honest arrays of that name and shape."""
    groups: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
    for update in honest:
        for name, array in update.items():
            groups.setdefault((name, array.shape), []).append(np.asarray(array, dtype=np.float64))
    return {
        key: (
            np.mean(arrays, axis=0),
            np.std(arrays, axis=0, ddof=1) if len(arrays) > 1 else np.zeros_like(arrays[0]),
        )
        for key, arrays in groups.items()
    }


class AttackedGrid(InProcessGrid):
    """The in-process grid whose attacking sites' training replies are replaced after every site has run."""

    def __init__(
        self,
        client_app: ClientApp,
        num_sites: int,
        run_config: dict | None = None,
        *,
        attack: Attack,
        **kwargs,
    ) -> None:
        super().__init__(client_app, num_sites, run_config, **kwargs)
        self.attack = attack
        self.attacker_nodes = attack.attackers(self.contexts)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterator[Message]:
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if not any(
            m.metadata.message_type == MessageType.TRAIN
            and m.metadata.dst_node_id in self.attacker_nodes
            for m in messages
        ):
            yield from replies
            return
        honest = list(replies)  # the round's honest updates, before any attacker's is forged
        server_round = int(messages[0].metadata.group_id or 0)
        arrays = {
            reply.metadata.src_node_id: _arrays(reply) for reply in honest if not reply.has_error()
        }
        updates = {
            node: {name: array.numpy() for name, array in record.items()}
            for node, (_, record) in arrays.items()
        }
        forged = self.attack.apply(updates, self.attacker_nodes, server_round)
        for reply in honest:
            node = reply.metadata.src_node_id
            if node in forged:
                key, _ = arrays[node]
                reply.content[key] = ArrayRecord(
                    {name: Array(np.ascontiguousarray(a)) for name, a in forged[node].items()}
                )
            yield reply


def _arrays(reply: Message) -> tuple[str, ArrayRecord]:
    return next(
        (key, record) for key, record in reply.content.items() if isinstance(record, ArrayRecord)
    )
