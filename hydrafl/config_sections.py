"""The sections of a run's configuration, each with its own keys and the checks that need only them.

`hydrafl.config.RunConfig` is all of them together (plus the strategy and its knobs) and adds the checks that
span sections. A section is a dataclass of its own, so it is built and validated alone too, and a key is
declared, documented and checked in one place. TOML files and the command line stay flat: a key's name says
which section holds it. Nothing here imports torch, the cohorts or the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hydrafl.catalog import INNER_OPTIMIZERS, NEXT_TOKEN_TASKS, SITE_TIERS, TASKS, has_images
from hydrafl.compression.layout import CompressionError, Scheme
from hydrafl.validation import ConfigError
from hydrafl.validation import check as _check

DUPLICATE_TASKS = ("clinical-text", "tabular")
"""The synthetic cohorts that can plant cross-site duplicates (`hydrafl.data.duplicates`)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which data each site trains on."""

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
    samples_per_site: int = 400
    """Synthetic cohort size per site."""
    seed: int = 0
    """Same seed, same numbers."""
    duplicates: float = 0.0
    """Synthetic clinical-text and tabular cohorts: plant copies of this fraction of the other sites' training
    records at site 0 (half exact, half near copies), as hospitals that share patients hold them."""
    dedup: bool = False
    """Before round 1, find the training records that near-duplicate another site's (keyed MinHash and LSH over
    the sites' signatures; every site needs the consortium's dedup key) and train on one copy of each."""
    dedup_threshold: float = 0.8
    """The estimated Jaccard similarity (of a note's words, a row's column=value pairs) from which two records
    at two sites count as one."""

    def __post_init__(self) -> None:
        _check(
            0 <= self.duplicates <= 1
            and (not self.duplicates or (not self.data and self.task in DUPLICATE_TASKS)),
            "duplicates",
            self.duplicates,
            f"a fraction in [0, 1], planted in the synthetic {' and '.join(DUPLICATE_TASKS)} cohorts only "
            "(0 otherwise)",
        )
        _check(
            0 < self.dedup_threshold <= 1,
            "dedup-threshold",
            self.dedup_threshold,
            "a float in (0, 1]",
        )
        _check(
            not self.dedup or not has_images(task=self.task, data=self.data),
            "dedup",
            self.dedup,
            "false for images: deduplication compares the words of notes and the values of table rows",
        )
        if not self.data and self.task not in TASKS + NEXT_TOKEN_TASKS:
            raise ConfigError(
                f"unknown task {self.task!r}; choose one of {', '.join(TASKS + NEXT_TOKEN_TASKS)}, "
                "or pass --data for your own data"
            )
        _check(
            self.samples_per_site >= 2, "samples-per-site", self.samples_per_site, "an integer >= 2"
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model every site builds, its LoRA adapters and its distillation teacher."""

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
    distill_teacher: str = ""
    """Next-token tasks: distil from a frozen teacher, "init" (the seeded initial model, a smoke test) or a local
    causal-LM checkpoint directory with the task's vocabulary; "" trains on cross-entropy alone."""
    distill_weight: float = 0.5
    """Weight w of KL(teacher || student) in the site loss CE + w * KL (teacher signal: hidden states + LM head)."""

    def __post_init__(self) -> None:
        _check(self.lora_rank >= 0, "lora-rank", self.lora_rank, "an integer >= 0 (0 = no LoRA)")
        _check(self.lora_alpha > 0, "lora-alpha", self.lora_alpha, "a float > 0")
        _check(self.distill_weight >= 0, "distill-weight", self.distill_weight, "a float >= 0")

    @property
    def lora_target_list(self) -> tuple[str, ...]:
        """`lora_targets` split (empty: the attention projections)."""
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How each site trains in a round."""

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
    nproc: int = 1
    """Processes each site trains with (torch.distributed + DDP; 1 trains in process). A real site's own
    `--nproc` wins. The batch size must be a multiple of it."""
    bf16: bool = False
    """Train under bfloat16 autocast (a real site's own `--bf16` wins)."""
    stream_layers: bool = False
    """Stream the transformer blocks through the device a window at a time, from host memory or disk, for a
    model whose weights and optimizer state do not fit (a real site's own `--stream-layers` wins); one process."""
    window: int = 2
    """With stream-layers: blocks materialised at once (a real site's own `--window` wins)."""

    def __post_init__(self) -> None:
        _check(self.local_steps >= 1, "local-steps", self.local_steps, "an integer >= 1")
        _check(self.batch_size >= 1, "batch-size", self.batch_size, "an integer >= 1")
        _check(self.lr > 0, "lr", self.lr, "a float > 0")
        _check(
            self.inner_optimizer in INNER_OPTIMIZERS,
            "inner-optimizer",
            self.inner_optimizer,
            ", ".join(INNER_OPTIMIZERS),
        )
        _check(self.nproc >= 1, "nproc", self.nproc, "an integer >= 1")
        _check(self.window >= 1, "window", self.window, "an integer >= 1")
        _check(
            not self.stream_layers or (self.nproc == 1 and self.inner_optimizer != "lm-dual"),
            "stream-layers",
            self.stream_layers,
            "false with nproc > 1 or lm-dual (a streamed site trains one process with a gradient "
            "optimizer)",
        )
        _check(
            self.batch_size % self.nproc == 0,
            "batch-size",
            self.batch_size,
            f"a multiple of nproc={self.nproc} (each process trains an equal share of the batch)",
        )


@dataclass(frozen=True, kw_only=True)
class FederationConfig:
    """The sites, the rounds, what a round waits for, and the coordinator's screening of replies."""

    sites: int = 4
    """Number of (simulated) hospital sites."""
    rounds: int = 15
    """Federated rounds."""
    min_sites: int = 0
    """A round with fewer successful replies fails the run; 0 means every sampled site must answer (under
    --secagg: the protocol's threshold)."""
    fraction_train: float = 1.0
    """Fraction of the sites each training round samples (seeded, as Flower's strategies sample: int(sites x
    fraction) of them, at least `--min-sites`); evaluation asks every site. 1 = every site trains every round."""
    fraction_evaluate: float = 1.0
    """Fraction of the sites each round's evaluation asks (seeded, as training samples); 0 evaluates on no site,
    which saves sending a large model to every site each round for its metrics."""
    round_timeout_s: float = 0.0
    """How long a round waits for replies; 0 waits for all (under --secagg: SECAGG_ROUND_TIMEOUT_S)."""
    site_wait_s: float = 120.0
    """How long the run waits at start for `--min-sites` sites to connect."""
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
    diagnostics: bool = False
    """Per round, the pseudo-gradient noise scale B_pg of the sites' deltas and (simulation) the cosine between
    the averaged delta and a full-data delta, which costs one extra training run per round."""
    screen_norm: float = 0.0
    """Screening: reject a reply whose update norm is above this many times the round's median; 0 = off."""
    screen_cosine: float = -1.0
    """Screening: reject a reply whose cosine to the others' mean update is below this; -1 = off."""

    def __post_init__(self) -> None:
        _check(self.sites >= 1, "sites", self.sites, "an integer >= 1")
        _check(self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
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
        _check(
            0 <= self.fraction_evaluate <= 1,
            "fraction-evaluate",
            self.fraction_evaluate,
            "a fraction in [0, 1] (0: no evaluation)",
        )
        _check(self.round_timeout_s >= 0, "round-timeout-s", self.round_timeout_s, "seconds >= 0")
        tiers = self.tier_list
        _check(
            all(t in SITE_TIERS for t in tiers) and len(tiers) <= self.sites,
            "site-tiers",
            self.site_tiers,
            f"at most {self.sites} comma-separated names from {', '.join(SITE_TIERS)} (cycled over "
            "the sites), or empty",
        )
        for key, values in (("site-memory-mb", self.memory_list), ("site-speeds", self.speed_list)):
            _check(
                len(values) <= self.sites
                and all(v >= 0 for v in values)
                and (key != "site-speeds" or 0 not in values),
                key,
                getattr(self, key.replace("-", "_")),
                f"at most {self.sites} comma-separated numbers (cycled over the sites; speeds > 0, "
                "memory >= 0), or empty",
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
    def sites_per_round(self) -> int:
        """The sites a training round samples (Flower's `int(sites x fraction_train)`)."""
        return int(self.sites * self.fraction_train)

    @property
    def available_sites(self) -> int:
        """Sites that must be connected before the run starts and before a round samples: `--min-sites`,
        else every site a round samples."""
        return self.min_sites or self.sites_per_round


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """Differential privacy and secure aggregation."""

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

    def __post_init__(self) -> None:
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
            "a float > 0 with --dp-noise-multiplier or --dp-adaptive (noise is calibrated to the "
            "clipping bound)",
        )
        _check(0 < self.dp_delta < 1, "dp-delta", self.dp_delta, "a float in (0, 1)")
        _check(
            self.secagg_max_weight >= 1,
            "secagg-max-weight",
            self.secagg_max_weight,
            "an integer >= 1",
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
            not (self.secagg and self.dp_adaptive),
            "dp-adaptive",
            self.dp_adaptive,
            "off with --secagg: adaptive clipping needs each site's clipped-or-not bit, which the "
            "coordinator never sees",
        )


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """How updates (and, optionally, downloads) are compressed on the wire."""

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
        try:
            self.scheme  # noqa: B018  (building it checks the scheme's keys)
        except CompressionError as error:
            raise ConfigError(str(error)) from None
        _check(
            not self.compress_downloads or self.compress != "none",
            "compress-downloads",
            self.compress_downloads,
            "off without --compress SCHEME: downloads are compressed in the upload scheme",
        )

    @property
    def scheme(self) -> Scheme:
        """The compression scheme these keys name (`hydrafl.compression.layout`)."""
        return Scheme(
            name=self.compress,
            topk_fraction=self.compress_topk_fraction,
            rank=self.compress_rank,
            block=self.compress_block,
        )


JOBS = ("train", "stats")


@dataclass(frozen=True, kw_only=True)
class StatsConfig:
    """What a run does (train, or report the cohorts' statistics) and the bins statistics are counted in. The
    bin edges come from here, never from the data: choosing them reveals nothing of any site."""

    job: str = "train"
    """train, or stats: no training; each site reports counts, labels, missing values and histograms on the
    shared bins (its policy suppresses small cells and may add noise), combined into stats.md and PNGs."""
    stats_bins: int = 10
    """Statistics: bins between LO and HI of every histogram (plus one open bin below and one above)."""
    stats_range: str = "-4:4"
    """Statistics: LO:HI of every feature's (and image channel mean's) histogram, or one LO:HI per feature,
    comma-separated. Simulated cohorts are standardised (mean 0, sd 1), which -4:4 covers; a site reading its
    own table reports raw values: give its columns' ranges."""

    def __post_init__(self) -> None:
        _check(self.job in JOBS, "job", self.job, " or ".join(JOBS))
        _check(1 <= self.stats_bins <= 1000, "stats-bins", self.stats_bins, "an integer in 1..1000")
        self.stats_ranges  # noqa: B018  (parsed here to refuse a bad range before any work)

    @property
    def stats_ranges(self) -> tuple[tuple[float, float], ...]:
        """`stats_range` as (LO, HI) pairs: one for every feature, or one per feature."""
        pairs = []
        for part in self.stats_range.split(","):
            low, _, high = part.partition(":")
            try:
                pair = (float(low), float(high))
            except ValueError:
                pair = (math.nan, math.nan)
            _check(
                math.isfinite(pair[0]) and math.isfinite(pair[1]) and pair[0] < pair[1],
                "stats-range",
                self.stats_range,
                "LO:HI with LO < HI, or one LO:HI per feature, comma-separated (e.g. -4:4 or 18:100,0:12)",
            )
            pairs.append(pair)
        return tuple(pairs)


SECTIONS = (
    DataConfig,
    ModelConfig,
    TrainingConfig,
    FederationConfig,
    PrivacyConfig,
    CompressionConfig,
    StatsConfig,
)
"""In the order `hydrafl keys` lists them."""


def _numbers(text: str, key: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{key} must be comma-separated numbers, got {text!r}") from None
