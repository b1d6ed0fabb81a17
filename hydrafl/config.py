"""Run configuration: the run-wide settings and the chosen strategy's own knobs, validated once at the edge.

`RunConfig` is everything the ServerApp and ClientApp of one federated run need; it travels as Flower's
flat `run_config` (str/int/float/bool only, so "" means "not set"): the run-wide keys and the strategy's knobs
side by side, every key kebab-case. The knobs belong to the strategy's `StrategyConfig` (`hydrafl.strategies`),
so this module knows no strategy by name. `SimulationConfig` adds what `hydrafl simulate` needs to compare
several strategies (`hydrafl.simulation_config`). TOML files use the CLI flag names. Nothing here imports torch, the cohorts or the kernels.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from hydrafl.catalog import (
    IMAGE_MODELS,
    INNER_OPTIMIZERS,
    NEXT_TOKEN_TASKS,
    SITE_TIERS,
    TASKS,
    has_images,
    run_model,
)
from hydrafl.compression.layout import CompressionError, Scheme
from hydrafl.field_docs import field_types
from hydrafl.strategies.registry import (
    StrategyConfig,
    UnknownStrategy,
    config_class,
    knob_names,
    mean_strategies,
    refuse_unknown,
    strategies_with,
    strategy_names,
)
from hydrafl.validation import ConfigError
from hydrafl.validation import check as _check

log = logging.getLogger(__name__)

BACKENDS = ("inprocess", "ray")
ATTACKS = ("signflip", "scale", "gaussian", "alie", "ipm")
"""The simulated Byzantine attacks (`hydrafl.simulation.attacks`)."""
DEFAULT_STRATEGIES = ("fedavg", "fedprox", "fedadam", "diloco")
COMPARISON_LORA_RANK = 8
SECAGG_ROUND_TIMEOUT_S = 600.0
"""A secure round's deadline when the run sets none (`RunConfig.round_deadline_s`)."""
"""The rank a LoRA-only strategy runs at in a comparison whose run has no LoRA (`lora_rank` 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """One federated run of one strategy."""

    task: str = "clinical-text"
    """Synthetic cohort: clinical-text, chest-xray, tabular or clinical-notes-lm (next-token prediction on the
    notes with the tiny causal LM); ignored when `--data` is set."""
    data: str = ""
    """A CSV/JSONL file or an image folder to split across the sites instead of a synthetic cohort."""
    label_column: str = ""
    """Label column of a CSV/JSONL `--data` file."""
    partition: str = ""
    """natural (one hospital per site; synthetic cohorts only), iid, dirichlet:ALPHA or pathological:K; empty:
    natural for a synthetic cohort, iid for `--data`."""
    sites: int = 4
    """Number of (simulated) hospital sites."""
    samples_per_site: int = 400
    """Synthetic cohort size per site."""
    seed: int = 0
    """Same seed, same numbers."""
    model: str = "tiny"
    """"tiny" (seeded from scratch: the small CNN on an image folder, chosen by measurement, else the tiny
    transformer), "vit" or "cnn" (image tasks), "minilm" (pretrained MiniLM-L6 encoder, text tasks; needs
    hydrafl[minilm]) or a local checkpoint directory."""
    lora_rank: int = 0
    """PEFT LoRA rank; 0 trains the full model. With LoRA the federated coordinates are the LoRA factors and
    the classification head. The LoRA-family strategies give each site a rank up to this one by its tier."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is alpha / lora_rank * B A)."""
    lora_targets: str = ""
    """Comma-separated module-name suffixes LoRA adapts (e.g. query,value); "" = the q/k/v/o projections."""
    strategy: str = "fedavg"
    """The strategy (`hydrafl strategies` lists them and their knobs); "" in a site's view of the run."""
    options: StrategyConfig | None = None
    """The strategy's knobs; None takes its defaults."""
    rounds: int = 15
    """Federated rounds."""
    min_sites: int = 0
    """A round with fewer successful replies fails the run; 0 means every sampled site must answer (under
    --secagg: the protocol's threshold)."""
    fraction_train: float = 1.0
    """Fraction of the sites each training round samples (seeded, as Flower's strategies sample: int(sites x
    fraction) of them, at least `--min-sites`); evaluation asks every site. 1 = every site trains every round."""
    round_timeout_s: float = 0.0
    """How long a round waits for replies; 0 waits for all (under --secagg: SECAGG_ROUND_TIMEOUT_S)."""
    site_wait_s: float = 120.0
    """How long the run waits at start for `--min-sites` sites to connect."""
    local_steps: int = 10
    """Optimizer steps per site per round."""
    batch_size: int = 32
    """Site batch size."""
    lr: float = 2e-3
    """Inner (site) learning rate."""
    inner_optimizer: str = "adamw"
    """adamw, sgd, muon, or lm-dual (head-only Levenberg-Marquardt)."""
    weight_decay: float = 0.0
    """Inner optimizer weight decay."""
    site_tiers: str = ""
    """Hydra: comma-separated resource tier (small, medium, large) per simulated site, in partition order,
    cycling when there are fewer than sites ("small,large" over 4 sites: small, large, small, large); a site's
    own node_config `tier` wins. "" leaves sites untiered (budget `--hydra-layers`/`--hydra-heads`)."""
    site_memory_mb: str = ""
    """Hydra: comma-separated training memory (MB) each simulated site declares, in partition order (a real
    site: `hydrafl site --memory-mb`); 0 or "" = no memory limit. A site's Hydra-net is sized to fit it."""
    site_speeds: str = ""
    """Comma-separated relative speed per simulated site (1.0 = this machine; 0.25 = four times slower): Hydra
    sizes each Hydra-net with `--round-timeout-s` so its local steps fit the deadline; FedBuff's simulation runs
    on a virtual clock where a site's local round lasts 1 / its speed."""
    run_dir: str = ""
    """Where the run checkpoints every round; "" disables checkpoints."""
    resume: bool = False
    """Continue from the last checkpoint in `--run-dir` instead of starting over."""
    nproc: int = 1
    """Processes each site trains with (torch.distributed + DDP; 1 trains in process). A real site's own
    `--nproc` wins. The batch size must be a multiple of it."""
    bf16: bool = False
    """Train under bfloat16 autocast (a real site's own `--bf16` wins)."""
    distill_teacher: str = ""
    """Next-token tasks: distil from a frozen teacher, "init" (the seeded initial model, a smoke test) or a local
    causal-LM checkpoint directory with the task's vocabulary; "" trains on cross-entropy alone."""
    distill_weight: float = 0.5
    """Weight w of KL(teacher || student) in the site loss CE + w * KL (teacher signal: hidden states + LM head)."""
    diagnostics: bool = False
    """Per round, the pseudo-gradient noise scale B_pg of the sites' deltas and (simulation) the cosine between
    the averaged delta and a full-data delta, which costs one extra training run per round."""
    dp_noise_multiplier: float = 0.0
    """Central differential privacy: Gaussian noise of std z * dp_clip on the sum of the sites' clipped updates
    (z / n per coordinate of the mean, n the sites that trained it); 0 = no noise. With --secagg the sites add
    it, each a Skellam share before masking (`hydrafl.secagg.noise`)."""
    dp_clip: float = 0.0
    """Central DP: L2 bound on each site's update (the initial bound with `--dp-adaptive`); 0 = no clipping."""
    dp_adaptive: bool = False
    """Central DP: adapt the clipping bound each round towards the median update norm (Andrew et al., 2021)."""
    dp_delta: float = 1e-5
    """The delta of the (epsilon, delta) the run reports after every round."""
    secagg: bool = False
    """Secure aggregation (SecAgg+): the coordinator learns only the sum of the sites' updates and weights."""
    secagg_max_weight: int = 1000
    """Secure aggregation: the largest example count a site may weigh with; its update is scaled by w / this
    into the quantiser's range, so a larger bound costs precision (error <= sites x bound x 16 / 2^22)."""
    secagg_threshold: int = 0
    """Secure aggregation: sites whose shares rebuild a dropped site's masks; 0 = a majority of the sites."""
    secagg_clip: float = 0.0
    """Secure aggregation: each honest site clips its whole update to this L2 norm before masking (a bound on
    what one site adds to the sum); 0 = off. Enforced by the sites only: a modified site skips it, nothing
    proves it was applied. With --dp-clip the sites clip to that instead."""
    screen_norm: float = 0.0
    """Screening: reject a reply whose update norm is above this many times the round's median; 0 = off."""
    screen_cosine: float = -1.0
    """Screening: reject a reply whose cosine to the round's mean update is below this; -1 = off."""
    compress: str = "none"
    """Compress each site's update for upload: none, bf16, int8 or int4 (per-block scales), topk (sparsification) or
    powersgd (low-rank factors of matrices); what is lost stays at the site and joins its next update."""
    compress_topk_fraction: float = 0.05
    """topk: the fraction of each tensor's coordinates a site sends, in (0, 0.5]."""
    compress_rank: int = 4
    """powersgd: the rank of each matrix's factors."""
    compress_block: int = 256
    """int8, int4: coordinates per float32 scale."""
    compress_downloads: bool = False
    """Compress the model sent to sites too, in the `--compress` scheme: each site gets the change from the model
    it holds, what is lost stays at the coordinator for later messages; the whole model at first contact, for a
    stale site and for the final evaluation (`hydrafl.compression.downloads`)."""

    def __post_init__(self) -> None:
        if (
            self.strategy
        ):  # "" is a site's view of the run: which strategy runs is the coordinator's business
            options_class = checked_config_class(self.strategy)
            if self.options is None:
                object.__setattr__(self, "options", options_class())
            _check(
                type(self.options) is options_class,
                "strategy",
                self.strategy,
                f"a strategy whose knobs are {type(self.options).__name__} (got them for another strategy)",
            )
        if (
            not self.data and self.task not in TASKS + NEXT_TOKEN_TASKS
        ):  # the words the cohort loader uses
            raise ConfigError(
                f"unknown task {self.task!r}; choose one of {', '.join(TASKS + NEXT_TOKEN_TASKS)}, or "
                "pass --data for your own data"
            )
        _check(self.sites >= 1, "sites", self.sites, "an integer >= 1")
        _check(self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
        _check(self.local_steps >= 1, "local-steps", self.local_steps, "an integer >= 1")
        _check(self.batch_size >= 1, "batch-size", self.batch_size, "an integer >= 1")
        _check(
            self.samples_per_site >= 2, "samples-per-site", self.samples_per_site, "an integer >= 2"
        )
        _check(
            0 < self.fraction_train <= 1 and self.sites_per_round >= 1,
            "fraction-train",
            self.fraction_train,
            f"a fraction in (0, 1] that samples at least one of the {self.sites} sites",
        )
        _check(
            0 <= self.min_sites <= self.sites_per_round,
            "min-sites",
            self.min_sites,
            f"0..{self.sites_per_round} (0 = every sampled site; at most the sites a round samples)",
        )
        _check(self.lr > 0, "lr", self.lr, "a float > 0")
        _check(self.round_timeout_s >= 0, "round-timeout-s", self.round_timeout_s, "seconds >= 0")
        _check(
            self.inner_optimizer in INNER_OPTIMIZERS,
            "inner-optimizer",
            self.inner_optimizer,
            ", ".join(INNER_OPTIMIZERS),
        )
        _check(
            self.inner_optimizer != "lm-dual"
            or (
                self.task not in NEXT_TOKEN_TASKS
                and self.nproc == 1
                and not self._knob_class.site_proximal_term
            ),
            "inner-optimizer",
            self.inner_optimizer,
            "not lm-dual here: it steps a classifier's head in one process, without a proximal term "
            "(a classification task, nproc 1, not FedProx)",
        )
        tiers = self.tier_list
        _check(
            all(t in SITE_TIERS for t in tiers) and len(tiers) <= self.sites,
            "site-tiers",
            self.site_tiers,
            f"at most {self.sites} comma-separated names from {', '.join(SITE_TIERS)} (cycled over the sites), or empty",
        )
        for key, values in (("site-memory-mb", self.memory_list), ("site-speeds", self.speed_list)):
            _check(
                len(values) <= self.sites
                and all(v >= 0 for v in values)
                and (key != "site-speeds" or 0 not in values),
                key,
                getattr(self, key.replace("-", "_")),
                f"at most {self.sites} comma-separated numbers (cycled over the sites; speeds > 0, memory >= 0), or empty",
            )
        _check(self.nproc >= 1, "nproc", self.nproc, "an integer >= 1")
        _check(
            self.batch_size % self.nproc == 0,
            "batch-size",
            self.batch_size,
            f"a multiple of nproc={self.nproc} (each process trains an equal share of the batch)",
        )
        _check(self.lora_rank >= 0, "lora-rank", self.lora_rank, "an integer >= 0 (0 = no LoRA)")
        _check(self.distill_weight >= 0, "distill-weight", self.distill_weight, "a float >= 0")
        _check(
            not self.distill_teacher or (self.task in NEXT_TOKEN_TASKS and not self.data),
            "distill-teacher",
            self.distill_teacher,
            f"empty unless the task is a synthetic next-token task ({', '.join(NEXT_TOKEN_TASKS)})",
        )
        _check(self.lora_alpha > 0, "lora-alpha", self.lora_alpha, "a float > 0")
        _check(
            self.dp_noise_multiplier >= 0,
            "dp-noise-multiplier",
            self.dp_noise_multiplier,
            "a float >= 0",
        )
        _check(self.dp_clip >= 0, "dp-clip", self.dp_clip, "a float >= 0 (0 = no clipping)")
        _check(
            self.dp_clip > 0 or not (self.dp_noise_multiplier or self.dp_adaptive),
            "dp-clip",
            self.dp_clip,
            "a float > 0 with --dp-noise-multiplier or --dp-adaptive (noise is calibrated to the clipping bound)",
        )
        _check(0 < self.dp_delta < 1, "dp-delta", self.dp_delta, "a float in (0, 1)")
        if (
            self.dp_clip and self.strategy and not self._knob_class.secure_sum
        ):  # the list loads every strategy
            _check(
                False,
                "dp-clip",
                self.dp_clip,
                f"0 for strategy {self.strategy!r}: its output is not a post-processing of the noised mean of the "
                f"clipped updates, so the accounted epsilon would not bound it (use one of {', '.join(mean_strategies())})",
            )
        robust_rule = getattr(self.options, "robust_rule", "mean")
        _check(
            robust_rule == "mean" or not self.dp_clip,
            "robust-rule",
            robust_rule,
            "mean with --dp-clip (central DP calibrates its noise to the clipped mean, not to a median)",
        )
        _check(
            self.secagg_max_weight >= 1,
            "secagg-max-weight",
            self.secagg_max_weight,
            "an integer >= 1",
        )
        _check(
            self.secagg_threshold == 0
            or max(2, self.sites // 2 + 1) <= self.secagg_threshold <= self.sites,
            "secagg-threshold",
            self.secagg_threshold,
            f"0 (a majority) or {max(2, self.sites // 2 + 1)}..{self.sites}: "
            "at or below half the sites, a coordinator that lies can unmask one site's update",
        )
        _check(
            math.isfinite(self.secagg_clip) and self.secagg_clip >= 0,
            "secagg-clip",
            self.secagg_clip,
            "a number >= 0 (0 = off)",
        )
        _check(
            not self.secagg_clip or (self.secagg and not self.dp_clip),
            "secagg-clip",
            self.secagg_clip,
            "0 without --secagg, and 0 with --dp-clip (the sites already clip to --dp-clip)",
        )
        _check(
            self.screen_norm == 0 or self.screen_norm >= 1,
            "screen-norm",
            self.screen_norm,
            "0 (off) or >= 1",
        )
        _check(
            -1 <= self.screen_cosine <= 1,
            "screen-cosine",
            self.screen_cosine,
            "a float in [-1, 1] (-1 = off)",
        )
        self._check_compression()
        # secure aggregation hands the coordinator the sites' sum alone: whatever needs one site's update refuses
        _check(
            not self.secagg or not self.strategy or self._knob_class.secure_sum,
            "secagg",
            self.secagg,
            f"off for strategy {self.strategy!r}: it needs each site's own update, not their sum",
        )
        _check(
            not (self.secagg and self.dp_clip) or not self._knob_class.slices_transformer,
            "dp-clip",
            self.dp_clip,
            f"0 with --secagg for strategy {self.strategy!r}: distributed DP noises whole-model sums, and its "
            "sites train slices",
        )
        _check(
            not (self.secagg and self.dp_adaptive),
            "dp-adaptive",
            self.dp_adaptive,
            "off with --secagg: adaptive clipping needs each site's clipped-or-not bit, which the coordinator never sees",
        )
        for key, value, off in (
            ("screen-norm", self.screen_norm, 0.0),
            ("screen-cosine", self.screen_cosine, -1.0),
            ("diagnostics", self.diagnostics, False),
            ("robust-rule", getattr(self.options, "robust_rule", "mean"), "mean"),
        ):
            _check(
                not self.secagg or value == off,
                key,
                value,
                f"{off} with --secagg: the coordinator never sees one site's update",
            )
        _check(
            not self._knob_class.federates_lora or self.lora_rank > 0,
            "lora-rank",
            self.lora_rank,
            f"an integer >= 1: strategy {self.strategy} federates LoRA adapters",
        )
        self._check_model()

    def _check_compression(self) -> None:
        try:
            Scheme(
                name=self.compress,
                topk_fraction=self.compress_topk_fraction,
                rank=self.compress_rank,
                block=self.compress_block,
            )
        except CompressionError as error:
            raise ConfigError(str(error)) from None
        _check(
            not self.secagg or self.compress == "none",
            "compress",
            self.compress,
            "none with --secagg: masked updates are summed exactly, not decoded one by one",
        )
        _check(
            not self.compress_downloads or self.compress != "none",
            "compress-downloads",
            self.compress_downloads,
            "off without --compress SCHEME: downloads are compressed in the upload scheme",
        )

    def _check_model(self) -> None:
        """An image model needs images; the small CNN has no layers, heads or projections to slice or adapt, so
        the Hydra-net strategies, the LoRA baselines and LoRA itself need the tiny ViT."""
        model, slices = (
            run_model(self.model, task=self.task, data=self.data),
            self._knob_class.slices_transformer,
        )
        _check(
            model not in IMAGE_MODELS or has_images(task=self.task, data=self.data),
            "model",
            self.model,
            f"a model for this task: {' and '.join(IMAGE_MODELS)} need images (an image folder or cohort)",
        )
        wants = f"strategy {self.strategy}" if slices else f"lora-rank {self.lora_rank}"
        _check(
            model != "cnn" or not (slices or self.lora_rank),
            "model",
            self.model,
            f"--model vit with {wants}: it slices or adapts transformer layers, which the small CNN "
            "(the default for an image folder) has not",
        )

    @classmethod
    def build(cls, **values: Any) -> RunConfig:
        """A run from flat snake_case keys: the run-wide ones and the strategy's knobs side by side. A key
        that is neither is refused, naming it and the strategies that have such a knob."""
        run, knobs = _split(values, str(values.get("strategy", "fedavg")), "arguments")
        try:
            options = config_class(run.get("strategy", "fedavg"))(**knobs)
        except UnknownStrategy as error:
            raise ConfigError(str(error)) from None
        return cls(**run, options=options)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some run-wide keys or knobs changed; a new strategy keeps the knobs it shares."""
        flat = {**self.flat(), **changes}
        if "strategy" in changes:
            keep = set(knob_names(config_class(changes["strategy"]))) | set(changes)
            flat = {key: value for key, value in flat.items() if key in RUN_KEYS or key in keep}
        return RunConfig.build(**flat)

    def flat(self) -> dict[str, Any]:
        """Run-wide keys and knobs in one snake_case mapping."""
        run = {name: getattr(self, name) for name in RUN_KEYS}
        return {**run, **(dataclasses.asdict(self.options) if self.options is not None else {})}

    @property
    def _knob_class(self) -> type[StrategyConfig]:
        return type(self.options) if self.options is not None else StrategyConfig

    @property
    def tier_list(self) -> tuple[str, ...]:
        """`site_tiers` split per site (empty when sites are untiered)."""
        return tuple(t.strip() for t in self.site_tiers.split(",") if t.strip())

    @property
    def memory_list(self) -> tuple[float, ...]:
        """`site_memory_mb` split per site (empty: no site declares a memory limit)."""
        return _numbers(self.site_memory_mb, "site-memory-mb")

    @property
    def speed_list(self) -> tuple[float, ...]:
        """`site_speeds` split per site (empty: every site runs at this machine's speed)."""
        return _numbers(self.site_speeds, "site-speeds")

    @property
    def lora_target_list(self) -> tuple[str, ...]:
        """`lora_targets` split (empty: the attention projections)."""
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def required_sites(self) -> int:
        """Successful replies a training round needs: `--min-sites`, else every sampled site; under `--secagg`
        the protocol's threshold, since the survivors' shares recover the masks of the sites that dropped."""
        if self.min_sites or not self.secagg:
            return self.min_sites or self.sites_per_round
        from hydrafl.secagg.params import SecAggParams

        params = SecAggParams(
            max_weight=self.secagg_max_weight, reconstruction_threshold=self.secagg_threshold
        )
        return params.threshold(self.sites_per_round)

    @property
    def available_sites(self) -> int:
        """Sites that must be connected before the run starts and before a round samples: `--min-sites`, else
        every site a round samples."""
        return self.min_sites or self.sites_per_round

    @property
    def round_deadline_s(self) -> float | None:
        """How long a round waits for replies: `--round-timeout-s`; under `--secagg` without one,
        SECAGG_ROUND_TIMEOUT_S, so a site that vanishes mid-protocol cannot stall the round for ever (the
        survivors recover it while a threshold of them remain). None waits for every site."""
        return self.round_timeout_s or (SECAGG_ROUND_TIMEOUT_S if self.secagg else None)

    @property
    def sites_per_round(self) -> int:
        """The sites a training round samples (Flower's `int(sites x fraction_train)`)."""
        return int(self.sites * self.fraction_train)

    def to_flower(self) -> dict[str, bool | int | float | str]:
        """Flower's `run_config` form (flat scalars, kebab-case keys)."""
        return {name.replace("_", "-"): value for name, value in self.flat().items()}

    @classmethod
    def from_flower(
        cls,
        run_config: dict[str, Any],
        *,
        source: str = "the run config",
        other_knobs: bool = False,
    ) -> RunConfig:
        """Inverse of `to_flower`; a key that is neither run-wide nor one of the strategy's knobs is refused.
        With `other_knobs`, other strategies' knobs are dropped with a warning instead: a run stored by an
        older hydrafl, which kept every strategy's knobs in every run, still starts."""
        values = {key.replace("-", "_"): value for key, value in run_config.items()}
        strategy = str(values.get("strategy", "fedavg"))
        try:
            refuse_unknown([strategy])
        except UnknownStrategy as error:
            raise ConfigError(f"--strategy: {error}") from None
        run_wide = {name: value for name, value in values.items() if name in RUN_WIDE_KEYS}
        # the run-wide values first, without a strategy: before its module (and torch) loads, as simulate does
        cls(
            **{
                name: coerce(cls, name, name.replace("_", "-"), value, source)
                for name, value in run_wide.items()
            },
            strategy="",
        )
        if other_knobs:
            own = set(knob_names(checked_config_class(strategy)))
            dropped = sorted(
                k for k in values if k not in RUN_KEYS and k not in own and strategies_with(k)
            )
            if dropped:
                log.warning(
                    "%s: ignoring knobs of other strategies: %s", source, ", ".join(dropped)
                )
            values = {k: v for k, v in values.items() if k not in dropped}
        run, knobs = _split(values, strategy, source)
        options_class = checked_config_class(strategy)
        knobs = {
            name: coerce(options_class, name, name.replace("_", "-"), value, source)
            for name, value in knobs.items()
        }
        return cls(
            **{
                name: coerce(cls, name, name.replace("_", "-"), value, source)
                for name, value in run.items()
            },
            options=options_class(**knobs),
        )

    @staticmethod
    def flower_defaults(strategy: str) -> dict[str, bool | int | float | str]:
        """Each key's default for a run of `strategy`, in `to_flower` form (not a valid run by itself: a
        LoRA-only strategy has no default rank)."""
        run = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.name != "options"}
        knobs = {f.name: f.default for f in dataclasses.fields(checked_config_class(strategy))}
        return {
            name.replace("_", "-"): value
            for name, value in {**run, "strategy": strategy, **knobs}.items()
        }

    @classmethod
    def site_view(cls, config: dict[str, Any]) -> RunConfig:
        """The run as a site reads it from a message's config: the run-wide keys only. The message also
        carries the strategy's knobs and the protocol's keys, which are the coordinator's business."""
        values = {key.replace("-", "_"): value for key, value in config.items()}
        return cls(**{name: values[name] for name in RUN_WIDE_KEYS if name in values}, strategy="")


SIMULATION_KEYS = {"strategies", "backend", "out", "attack", "attackers", "site_policy", "workers"}
"""`hydrafl.simulation_config.SimulationConfig`'s own keys (valid in a comparison, not in one run)."""
RUN_WIDE_KEYS = tuple(
    f.name for f in dataclasses.fields(RunConfig) if f.name not in ("options", "strategy")
)
"""RunConfig's keys that are the same whichever strategy runs (snake_case)."""
RUN_KEYS = (*RUN_WIDE_KEYS, "strategy")


def checked_config_class(strategy: str, flag: str = "--strategy") -> type[StrategyConfig]:
    try:
        return config_class(strategy)
    except UnknownStrategy as error:
        raise ConfigError(f"{flag}: {error}") from None


def _split(
    values: dict[str, Any], strategy: str, source: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Snake_case `values` as (run-wide keys, the strategy's knobs); anything else names the key."""
    knobs_of_strategy = set(knob_names(checked_config_class(strategy)))
    run, knobs = {}, {}
    for name, value in values.items():
        if name in RUN_KEYS:
            run[name] = value
        elif name in knobs_of_strategy:
            knobs[name] = value
        else:
            raise ConfigError(unknown_key(name.replace("_", "-"), source, (strategy,)))
    return run, knobs


def unknown_key(
    key: str, source: str, strategies: tuple[str, ...], *, simulation: bool = False
) -> str:
    owners = strategies_with(key.replace("-", "_"))
    where = (
        f"it is a knob of {', '.join(owners)}, not of {', '.join(strategies)}"
        if owners
        else f"valid keys: {', '.join(valid_keys(strategies, simulation=simulation))}"
    )
    return f"unknown key {key!r} in {source}; {where}"


def _numbers(text: str, key: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{key} must be comma-separated numbers, got {text!r}") from None


def valid_keys(strategies: tuple[str, ...] = (), *, simulation: bool = False) -> list[str]:
    """Run-wide keys (and with `simulation` the comparison's), and the knobs of `strategies` (all if none)."""
    knobs = {k for s in strategies or strategy_names() for k in knob_names(config_class(s))}
    keys = set(RUN_WIDE_KEYS) | knobs | (SIMULATION_KEYS if simulation else {"strategy"})
    return sorted(key.replace("_", "-") for key in keys)


def coerce(cls: type, name: str, key: str, value: Any, source: str) -> Any:
    """Accept an int where a float is expected; reject any other type mismatch with the key named."""
    expected = field_types(cls)[name]
    kind = {"int": int, "float": float, "str": str, "bool": bool}[expected]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"key {key!r} in {source} must be {expected}, got {value!r}")
    return value
