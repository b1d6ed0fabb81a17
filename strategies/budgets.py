"""The knobs that size each site's share of the model, common to Hydra, the width and the LoRA baselines:
the untiered budget, and how sites score their layers and heads in the planning round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from hydrafl import protocol
from hydrafl.strategies.planner import SitePlanner
from hydrafl.strategies.robust import RobustConfig
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig

LAYER_SCORES = ("fisher", "taylor", protocol.MAGNITUDE_SCORE)
HEAD_SCORES = ("taylor", "confidence", protocol.MAGNITUDE_SCORE)


@dataclass(frozen=True, kw_only=True)
class BudgetConfig(RobustConfig):
    """A site's budget: its tier (the run's `site_tiers` or its own), else these untiered fractions; with a
    round deadline or a declared memory, what fits them. The robust-rule knobs come with it: every strategy
    sized by a budget aggregates a masked sum (`robust`)."""

    slices_transformer: ClassVar[bool] = True

    hydra_layers: float = 1.0
    """Fraction of the layers an untiered site trains."""
    hydra_heads: float = 1.0
    """Fraction of the heads (KV groups) per trained layer an untiered site keeps."""
    layer_score: str = "fisher"
    """Layer importance at the sites: fisher, taylor or magnitude (from the weights; what a private run uses)."""
    head_score: str = "taylor"
    """Head importance at the sites: taylor (gate gradient), confidence or magnitude (from the weights; what a
    private run uses)."""
    score_samples: int = 64
    """Training samples a site scores on."""

    def __post_init__(self) -> None:
        RobustConfig.__post_init__(self)
        check(0 < self.hydra_layers <= 1, "hydra-layers", self.hydra_layers, "a fraction in (0, 1]")
        check(0 < self.hydra_heads <= 1, "hydra-heads", self.hydra_heads, "a fraction in (0, 1]")
        check(
            self.layer_score in LAYER_SCORES,
            "layer-score",
            self.layer_score,
            ", ".join(LAYER_SCORES),
        )
        check(self.head_score in HEAD_SCORES, "head-score", self.head_score, ", ".join(HEAD_SCORES))
        check(self.score_samples >= 1, "score-samples", self.score_samples, "an integer >= 1")

    def planner(self, run: RunConfig, *, rescore_every: int = 0) -> SitePlanner:
        """The planning-round component sized by these knobs: the untiered fractions and, with the round
        deadline and local steps, each site's measured step cost against its declared memory and speed. A
        private run (central DP, secure aggregation) scores by weight magnitude: scores from one site's data
        would be released outside the epsilon, and seen by a coordinator that must learn only the sum."""
        private = bool(run.dp_clip or run.secagg)
        return SitePlanner(
            untiered=(self.hydra_layers, self.hydra_heads),
            rescore_every=rescore_every,
            timeout_s=run.round_timeout_s or None,
            local_steps=run.local_steps,
            scoring={
                protocol.LAYER_SCORE: protocol.MAGNITUDE_SCORE if private else self.layer_score,
                protocol.HEAD_SCORE: protocol.MAGNITUDE_SCORE if private else self.head_score,
                protocol.SCORE_SAMPLES: self.score_samples,
            },
        )
