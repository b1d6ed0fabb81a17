"""The run's privacy ledger, kept by the round driver: before a round's train messages leave, the epsilon the
run will have spent after it (each message carries the Renyi DP one, so a site can check its budget); after
the round, the epsilon spent by both accountants (Renyi DP and the exact PLD), the clipping bound used, and
each site's own (local DP) epsilon from its reply.

With secure aggregation the noise is the sites' (distributed DP, `hydrafl.secagg.noise`): the epsilon a round's
messages carry assumes the fewest survivors that can unmask a sum (the least noise), and the round is recorded
with the noise its survivors actually added (`dp_noise_multiplier`, z sqrt(survivors / sent) and a little
less); such runs have no exact (PLD) epsilon.

The accountant's input is rebuilt from the run's history on resume: per round with central DP, the sites
sampled (the round's train messages) out of the sites available, and the round's noise multiplier."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp.strategy import Strategy

from hydrafl import protocol
from hydrafl.privacy.central import round_clip
from hydrafl.rounds import RoundRecord
from hydrafl.updates import records

if TYPE_CHECKING:
    from hydrafl.secagg.params import SecAggParams


class PrivacyLedger:
    """Central DP's spending over a run (nothing with `noise_multiplier` 0) and the sites' reported spending."""

    noise_multiplier: float
    delta: float
    secagg: SecAggParams | None
    """Secure aggregation's parameters when the sites add the noise (distributed DP), else None."""
    samples: list[Any]
    """Per round with noise: its `accountant.RoundSample`."""
    noise_multipliers: list[float]
    """Per round with noise: the noise multiplier it had (the run's, or distributed DP's effective one)."""
    pending: tuple[Any, float, float | None, float | None, int] | None
    """The open round: its sample, the epsilon after it (Renyi DP, then exact), the clipping bound it uses and
    (distributed DP) the coordinates of an update."""

    def __init__(
        self, noise_multiplier: float, delta: float, secagg: SecAggParams | None = None
    ) -> None:
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.secagg = secagg if secagg is not None and secagg.dp_clip else None
        self.samples = []
        self.noise_multipliers = []
        self.pending = None

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], secagg: SecAggParams | None = None
    ) -> PrivacyLedger:
        """The ledger of a run whose Flower run_config is `run_config` (the driver's saved configuration) and
        whose secure aggregation, if any, runs with `secagg`; a run without central DP (no `dp-clip`) spends
        nothing, so its delta is never read."""
        if not run_config.get("dp-clip"):
            return cls(0.0, 0.0)
        if run_config.get("secagg") and (
            secagg is None or secagg.dp_clip != float(run_config["dp-clip"])
        ):
            raise ValueError(
                "a secure run with dp-clip needs it in its secure-aggregation parameters: the sites noise"
            )
        return cls(float(run_config["dp-noise-multiplier"]), float(run_config["dp-delta"]), secagg)

    def restore(self, history: Iterable[Mapping[str, Any]]) -> None:
        """The rounds a resumed run already spent, from its history."""
        from hydrafl.privacy.accountant import RoundSample

        spent = [
            entry
            for entry in history
            if entry.get("dp_epsilon") is not None and entry.get("dp_sites_available")
        ]
        self.samples = [
            RoundSample(entry["sites_ok"] + entry["sites_failed"], entry["dp_sites_available"])
            for entry in spent
        ]
        self.noise_multipliers = [
            entry.get("dp_noise_multiplier") or self.noise_multiplier for entry in spent
        ]

    def open_round(
        self,
        messages: Sequence[Message],
        sites_available: int,
        strategy: Strategy,
        arrays: ArrayRecord | None = None,
    ) -> None:
        """Before the round's train messages are sent: the spending after it goes into each message's config.
        `arrays`: the model the round starts from (distributed DP's sites encode all of it: a subnetwork's site
        expands its slices to full shape, while its message carries only what it reads)."""
        clip = round_clip(strategy) if self.secagg is None else self.secagg.dp_clip
        if not self.noise_multiplier or not messages:
            self.pending = None if clip is None else (None, math.nan, math.nan, clip, 0)
            return
        from hydrafl.privacy.accountant import RoundSample, epsilon, exact_epsilon

        sample = RoundSample(len(messages), max(sites_available, len(messages)))
        size = 0
        if self.secagg is None:
            spent = epsilon(self.noise_multiplier, [*self.samples, sample], delta=self.delta)
            exact: float | None = exact_epsilon(
                self.noise_multiplier, [*self.samples, sample], delta=self.delta
            )
        else:
            model = records(messages[0].content, ArrayRecord)[0] if arrays is None else arrays
            size = sum(math.prod(a.shape) for a in model.values())
            spent, exact = (
                self._distributed(sample, size, self.secagg.threshold(sample.sampled)),
                None,
            )
        for message in messages:
            for config in records(message.content, ConfigRecord):
                config[protocol.RUN_EPSILON] = spent
        self.pending = (sample, spent, exact, clip, size)

    def close_round(self, record: RoundRecord) -> None:
        """After the round's model was made: the spending and the bound go into its `RoundRecord`."""
        if self.pending is None:
            return
        sample, spent, exact, record.dp_clip, size = self.pending
        if sample is not None:
            noise_multiplier = self.noise_multiplier
            if self.secagg is not None:  # the survivors' noise, not the fewest the preview assumed
                noise_multiplier = self._noise(sample, size, record.sites_ok)
                spent = self._distributed(sample, size, record.sites_ok)
            self.samples.append(sample)
            self.noise_multipliers.append(noise_multiplier)
            record.dp_epsilon, record.dp_epsilon_exact, record.dp_sites_available = (
                spent,
                exact,
                sample.population,
            )
            record.dp_noise_multiplier = noise_multiplier
        self.pending = None

    def _noise(self, sample: Any, size: int, survivors: int) -> float:
        """Distributed DP: the effective noise multiplier of a round of `sample` that `survivors` sites summed."""
        from hydrafl.secagg.noise import DistributedNoise

        assert self.secagg is not None
        return DistributedNoise.of(self.secagg, size, sample.sampled).effective_noise_multiplier(
            survivors
        )

    def _distributed(self, sample: Any, size: int, survivors: int) -> float:
        """Distributed DP: the run's epsilon after the past rounds and one of `sample` that `survivors` summed."""
        from hydrafl.privacy.accountant import distributed_epsilon

        return distributed_epsilon(
            [*self.noise_multipliers, self._noise(sample, size, survivors)], delta=self.delta
        )

    @staticmethod
    def note_reply(reply: Message, record: RoundRecord) -> None:
        """A site's own epsilon, when its train reply reports one, into the round's record."""
        for config in records(reply.content, ConfigRecord):
            if protocol.LOCAL_EPSILON in config:
                record.local_epsilon_per_site[str(reply.metadata.src_node_id)] = float(
                    config[protocol.LOCAL_EPSILON]
                )
