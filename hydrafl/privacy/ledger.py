"""The run's privacy ledger, kept by the round driver: before a round's train messages leave, the epsilon the
run will have spent after it (each message carries the Renyi DP one, so a site can check its budget); after
the round, the epsilon spent by both accountants (Renyi DP and the exact PLD), the clipping bound used, and
each site's own (local DP) epsilon from its reply.

The accountant's input is rebuilt from the run's history on resume: per round with central DP, the sites
sampled (the round's train messages) out of the sites available."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flwr.app import ConfigRecord, Message
from flwr.serverapp.strategy import Strategy

from hydrafl import protocol
from hydrafl.privacy.central import round_clip
from hydrafl.rounds import RoundRecord
from hydrafl.updates import records


class PrivacyLedger:
    """Central DP's spending over a run (nothing with `noise_multiplier` 0) and the sites' reported spending."""

    noise_multiplier: float
    delta: float
    samples: list[Any]
    """Per round with central noise: its `accountant.RoundSample`."""
    pending: tuple[Any, float, float, float | None] | None
    """The open round: its sample, the epsilon after it (Renyi DP, then exact), and the clipping bound it uses."""

    def __init__(self, noise_multiplier: float, delta: float) -> None:
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.samples = []
        self.pending = None

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> PrivacyLedger:
        """The ledger of a run whose Flower run_config is `run_config` (the driver's saved configuration); a
        run without central DP (no `dp-clip`) spends nothing, so its delta is never read."""
        if not run_config.get("dp-clip"):
            return cls(0.0, 0.0)
        return cls(float(run_config["dp-noise-multiplier"]), float(run_config["dp-delta"]))

    def restore(self, history: Iterable[Mapping[str, Any]]) -> None:
        """The rounds a resumed run already spent, from its history."""
        from hydrafl.privacy.accountant import RoundSample

        self.samples = [
            RoundSample(entry["sites_ok"] + entry["sites_failed"], entry["dp_sites_available"])
            for entry in history
            if entry.get("dp_epsilon") is not None and entry.get("dp_sites_available")
        ]

    def open_round(self, messages: Sequence[Message], sites_available: int, strategy: Strategy) -> None:
        """Before the round's train messages are sent: the spending after it goes into each message's config."""
        clip = round_clip(strategy)
        if not self.noise_multiplier or not messages:
            self.pending = None if clip is None else (None, math.nan, math.nan, clip)
            return
        from hydrafl.privacy.accountant import RoundSample, epsilon, exact_epsilon

        sample = RoundSample(len(messages), max(sites_available, len(messages)))
        spent = epsilon(self.noise_multiplier, [*self.samples, sample], delta=self.delta)
        exact = exact_epsilon(self.noise_multiplier, [*self.samples, sample], delta=self.delta)
        for message in messages:
            for config in records(message.content, ConfigRecord):
                config[protocol.RUN_EPSILON] = spent
        self.pending = (sample, spent, exact, clip)

    def close_round(self, record: RoundRecord) -> None:
        """After the round's model was made: the spending and the bound go into its `RoundRecord`."""
        if self.pending is None:
            return
        sample, spent, exact, record.dp_clip = self.pending
        if sample is not None:
            self.samples.append(sample)
            record.dp_epsilon, record.dp_epsilon_exact, record.dp_sites_available = spent, exact, sample.population
        self.pending = None

    @staticmethod
    def note_reply(reply: Message, record: RoundRecord) -> None:
        """A site's own epsilon, when its train reply reports one, into the round's record."""
        for config in records(reply.content, ConfigRecord):
            if protocol.LOCAL_EPSILON in config:
                record.local_epsilon_per_site[str(reply.metadata.src_node_id)] = float(config[protocol.LOCAL_EPSILON])
