"""The ClientApp every hydrafl site runs, whichever runtime delivers its messages.

`train` trains the model it is given on the site's data and replies with the delta (start - end) of the
coordinates it trained; `evaluate` replies with loss/accuracy on the site's test split; `query.init` returns
the seeded initial model and `query.curvature` a cheap estimate of the loss curvature (top Hessian eigenvalue
and its per-sample variance) for the DiLoCo stability check.

Hydra-nets: `query.scores` replies with the site's layer and head importance on its own data, its declared
resource tier and the model's slice layout; a `train` message whose config carries a SubnetSpec (`hydra.*`
keys) trains only that subnetwork and replies with the deltas of exactly its slices, compact (`subnet.slices.extract`:
rows/columns of the kept heads or widths, tensors it does not touch omitted); the strategy knows the spec it
assigned and folds them back. Every train reply reports the site's trainable parameters and peak training
memory (`hydrafl.footprint`), its throughput and the round's data hash (`hydrafl.client.training`).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.nn.attention import SDPBackend, sdpa_kernel

from hydrafl import protocol
from hydrafl.arrays import to_record
from hydrafl.catalog import IMAGE_MODELS, MOE_MODEL
from hydrafl.client.dedup import deduplicated, drop_reply, signatures_reply
from hydrafl.client.model_probes import estimate_curvature, expert_scores, slice_layout
from hydrafl.client.site_costs import step_costs
from hydrafl.client.site_model import site_model
from hydrafl.client.site_stats import site_stats
from hydrafl.client.training import build_site_model, evaluate, site_seed, train_site
from hydrafl.config import RunConfig
from hydrafl.data import NEXT_TOKEN_TASKS, TASKS, Cohort, DataError, SiteSplit, load_cohort
from hydrafl.data.files import read_dataset
from hydrafl.data.text_cohort import MINILM, tokenizer_for
from hydrafl.footprint import training_footprint
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.models import (
    build_model,
    federated_state,
    lora_base_state,
    lora_spec,
    task_loss,
    training_loss,
)
from hydrafl.run_settings import message_keys, run_settings
from hydrafl.site_config import SiteConfig
from hydrafl.strategies.registry import site_half
from hydrafl.strategies.site import SiteHalf
from hydrafl.subnet.apply import apply_spec, trainable_slices
from hydrafl.subnet.scoring import head_importance, layer_importance, weight_magnitude
from hydrafl.subnet.slices import Slice, extract

log = logging.getLogger(__name__)

client_app = ClientApp()
SYNTHETIC_TASKS = TASKS + NEXT_TOKEN_TASKS


@lru_cache(maxsize=4)
def _cohort(
    task: str,
    data: str,
    label_column: str,
    partition: str,
    sites: int,
    samples: int,
    seed: int,
    tokenizer: str = "hash",
    duplicates: float = 0.0,
) -> Cohort:
    return load_cohort(
        task,
        num_sites=sites,
        seed=seed,
        partition=partition or None,
        data_path=data or None,
        label_column=label_column or None,
        samples_per_site=samples,
        text_tokenizer=tokenizer,
        duplicates=duplicates,
    )


def run_cohort(cfg: RunConfig) -> Cohort:
    """The cohort a run's sites share out (cached per process; loading it early surfaces data errors)."""
    tokenizer = tokenizer_for(cfg.model, cfg.data)
    return _cohort(
        cfg.task,
        cfg.data,
        cfg.label_column,
        cfg.partition,
        cfg.sites,
        cfg.samples_per_site,
        cfg.seed,
        tokenizer,
        cfg.duplicates,
    )


def site_data(cfg: RunConfig, context: Context) -> tuple[Cohort, SiteSplit]:
    """This site's data, without the training records the run's deduplication dropped (`all_site_data`)."""
    cohort, split = all_site_data(cfg, context)
    return cohort, deduplicated(split, context)


def all_site_data(cfg: RunConfig, context: Context) -> tuple[Cohort, SiteSplit]:
    """This site's data. A hospital site names its own file (`data-path` in its node_config); a demo site
    (`demo-site`) takes its share of the run task's synthetic cohort; a simulated site its `partition-id`; the
    simulation's full-data reference site (`pooled`) every site's training data together. Only the last two,
    whose node_config the simulation sets, read the run's `data`: a site never opens a path the run names."""
    site = _site(context)
    if site.pooled:
        cohort = run_cohort(cfg)
        empty = cohort.sites[0].test_x[:0], cohort.sites[0].test_y[:0]
        pooled_x = torch.cat([each.train_x for each in cohort.sites])
        pooled_y = torch.cat([each.train_y for each in cohort.sites])
        return cohort, SiteSplit(
            train_x=pooled_x, train_y=pooled_y, test_x=empty[0], test_y=empty[1]
        )
    if site.data_path is not None:
        cohort = _cohort("", str(site.data_path), site.label_column, "iid", 1, 2, cfg.seed)
        return cohort, cohort.sites[0]
    if site.demo_site is not None:
        cohort = demo_cohort(cfg)
        return cohort, cohort.sites[site.demo_site % len(cohort.sites)]
    if site.partition_id is None:
        raise ValueError(
            "this site's node_config names no data: data-path, demo-site or partition-id"
        )
    cohort = run_cohort(cfg)
    if not site.partition_id < len(cohort.sites):
        raise ValueError(
            f"partition-id {site.partition_id} is outside the cohort's {len(cohort.sites)} sites"
        )
    return cohort, cohort.sites[site.partition_id]


def train_class_counts(message: Message, context: Context) -> dict[str, int]:
    """Records per class of the training split a `train` message would train on, for the site policy's
    small-cell check before any training; empty for a task without class labels (next-token prediction)."""
    cohort, split = site_data(_run_config(context), context)
    if split.train_y.ndim != 1:
        return {}
    counts = torch.bincount(split.train_y, minlength=cohort.task.num_classes).tolist()
    return dict(zip(cohort.task.class_names, counts, strict=True))


def _site(context: Context) -> SiteConfig:
    """The site's own settings (`hydrafl site`'s flags, or what the simulation set), typed and checked."""
    return _parsed_site(tuple(sorted(context.node_config.items())))


@lru_cache(maxsize=64)
def _parsed_site(node_config: tuple[tuple[str, Any], ...]) -> SiteConfig:
    """Parsed and checked once per site, not once per message."""
    return SiteConfig.from_node_config(dict(node_config))


def demo_cohort(cfg: RunConfig) -> Cohort:
    """The synthetic cohort of the run's task, whatever file the run config names: the coordinator chooses
    what a demo site simulates, never which local file it reads."""
    if cfg.task not in SYNTHETIC_TASKS:
        raise DataError(
            f"this run's task {cfg.task!r} has no synthetic cohort (a run defined by a data file?), so a site "
            f"without --data cannot join it; start the site with its own --data, or run one of "
            f"{', '.join(SYNTHETIC_TASKS)}"
        )
    return run_cohort(dataclasses.replace(cfg, data="", label_column=""))


def _received_arrays(message: Message) -> ArrayRecord:
    return next(iter(message.content.array_records.values()))


def _run_config(context: Context) -> RunConfig:
    """The run's settings, from the site's Context (`hydrafl.run_settings`): parsed and checked once per run,
    not once per message."""
    return _parsed_run(
        tuple(sorted(context.run_config.items())), tuple(sorted(context.node_config.items()))
    )


def forget_parsed_settings() -> None:
    """Drop the parsed settings (a benchmark counting parses per run starts from none)."""
    _parsed_site.cache_clear()
    _parsed_run.cache_clear()


@lru_cache(maxsize=64)
def _parsed_run(
    run_config: tuple[tuple[str, Any], ...], node_config: tuple[tuple[str, Any], ...]
) -> RunConfig:
    cfg = RunConfig.site_view(dict(run_config))
    check_checkpoint_paths(cfg, _parsed_site(node_config))
    return cfg


def check_checkpoint_paths(cfg: RunConfig, site: SiteConfig) -> None:
    """A deployed site (`SiteConfig.deployed`, started by `hydrafl site`) loads a checkpoint directory the run
    names only from inside the directory its operator allowed (`hydrafl site --model-dir`): the coordinator
    chooses which model, never which local files a site reads (and sends back as `query.init`)."""
    if not site.deployed:
        return  # a simulated site: the run config is the researcher's own
    allowed = site.model_dir
    for key, value, built_in in (
        ("model", cfg.model, ("tiny", MOE_MODEL, MINILM, *IMAGE_MODELS)),
        ("distill-teacher", cfg.distill_teacher, ("", "init")),
    ):
        if value in built_in:
            continue
        if allowed is None or not Path(value).resolve().is_relative_to(allowed.resolve()):
            raise PermissionError(
                f"the run's {key} names a local directory outside this site's --model-dir"
            )


@client_app.train()
def train(message: Message, context: Context) -> Message:
    cfg, site = _run_config(context), _site(context)
    cohort, split = site_data(cfg, context)
    arrays, config = _received_arrays(message), message_keys(message)
    half = _strategy_half(message, context)  # the strategy's part: subnetwork, rank, loss, reply
    spec, rank = half.subnet(), half.lora_rank()
    model = site_model(cohort.task, cfg, arrays, spec, rank)
    start = {name: p.clone() for name, p in federated_state(model).items() if name in arrays}
    local = LocalTraining(
        steps=half.local_steps(cfg.local_steps, len(split.train_y), cfg.batch_size),
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        optimizer=cfg.inner_optimizer,
        weight_decay=cfg.weight_decay,
        nproc=cfg.nproc if site.nproc is None else site.nproc,  # the site's own hardware wins
        seed=site_seed(cfg.seed, site.index),
        server_round=int(config.get(protocol.SERVER_ROUND, 0)),
        bf16=cfg.bf16 if site.bf16 is None else site.bf16,
        max_restarts=site.max_restarts,
        nnodes=site.nnodes,
        rdzv=site.rdzv,
        stream_layers=cfg.stream_layers if site.stream_layers is None else site.stream_layers,
        window=cfg.window if site.window is None else site.window,
    )
    # copies: pickling for the spawned processes moves a tensor's storage into shared memory, and the working
    # model's own tensors there would be shared with every simulation worker forked later
    frozen = None
    if local.world_size > 1:
        frozen = {name: t.clone() for name, t in model.state_dict().items() if name not in start}
    lora = lora_spec(cfg, rank)
    rebuild = partial(
        build_site_model, cohort.task, cfg.model, cfg.seed, spec, lora=lora, frozen=frozen
    )
    teacher = {"distill_teacher": cfg.distill_teacher, "distill_weight": cfg.distill_weight}
    loss_fn = half.loss(
        training_loss(cohort.task, model=cfg.model, seed=cfg.seed, **teacher), start
    )
    with apply_spec(model, spec) if spec else nullcontext():
        sample = slice(0, min(cfg.batch_size, len(split.train_y)))
        footprint = training_footprint(
            model,
            lambda: loss_fn(model, split.train_x[sample], split.train_y[sample]),
            cfg.inner_optimizer,
        )
        result = train_site(
            model,
            start,
            split.train_x,
            split.train_y,
            local,
            rebuild=rebuild,
            loss_fn=loss_fn,
            spec=spec,
        )
    end = result.end_state
    if spec is not None:
        slices = trainable_slices(model, spec)
    else:  # the whole model, or a LoRA baseline's rank-r adapter: exactly its rank's components
        slices = {name: Slice(None) for name in start}
    # only the subnetwork's coordinates travel, as compact slices (the strategy knows which it assigned)
    delta = extract({name: start[name] - end[name] for name in slices}, slices)
    extra_arrays, extra_metrics = half.reply(start, end, local.steps, local.lr)
    metrics = MetricRecord(
        {
            protocol.WEIGHT: len(split.train_y),
            protocol.TRAINABLE_PARAMS: sum(
                sl.numel(start[name].shape) for name, sl in slices.items()
            ),
            protocol.PEAK_MEMORY: footprint.peak_bytes,
            "train_loss": result.loss,
            "samples-per-s": result.samples_per_s,
            **({"mfu": result.mfu} if result.mfu is not None else {}),
            **({"restarts": result.restarts} if result.restarts else {}),
            **({"stream-peak-bytes": result.peak_stream_bytes} if result.peak_stream_bytes else {}),
            **extra_metrics,
        }
    )
    utilisation = f", MFU {result.mfu:.1%}" if result.mfu is not None else ""
    if result.restarts:
        log.warning(
            "round %d: a training process died; restarted %d time(s)",
            local.server_round,
            result.restarts,
        )
    log.info(
        "round %d: %d samples on %d process(es), %.0f samples/s%s, loss %.4f, data %s",
        local.server_round,
        result.num_examples,
        local.world_size,
        result.samples_per_s,
        utilisation,
        result.loss,
        result.data_hash[:12],
    )
    info = ConfigRecord({protocol.DATA_HASH: result.data_hash})  # a string: metrics are numbers
    content = RecordDict(
        {"arrays": to_record(delta), **extra_arrays, "metrics": metrics, "train-info": info}
    )
    return Message(content, reply_to=message)


def _strategy_half(message: Message, context: Context) -> SiteHalf:
    """The site half of the run's strategy (`hydrafl.strategies.site`), on the run's settings and this
    message's keys; plain training when the strategy has none."""
    settings = run_settings(message, context)
    half = site_half(str(settings.get("strategy", ""))) or SiteHalf
    return half(settings, context.state, message.content.array_records)


@client_app.evaluate()
def evaluate_site(message: Message, context: Context) -> Message:
    cfg = _run_config(context)
    cohort, split = site_data(cfg, context)
    model = site_model(cohort.task, cfg, _received_arrays(message))
    loss, accuracy = evaluate(model, split.test_x, split.test_y)
    metrics = MetricRecord({protocol.WEIGHT: len(split.test_y), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


@client_app.query("init")
def initial_model(message: Message, context: Context) -> Message:
    cfg = _run_config(context)
    cohort, _ = site_data(cfg, context)
    model = build_model(cohort.task, model=cfg.model, seed=cfg.seed, lora=lora_spec(cfg))
    state = federated_state(model)
    if message_keys(message).get(protocol.LORA_BASES, False):
        state |= lora_base_state(model)
    return Message(RecordDict({"arrays": to_record(state)}), reply_to=message)


@client_app.query("dedup_signatures")
def dedup_signatures(message: Message, context: Context) -> Message:
    cohort, split = all_site_data(_run_config(context), context)
    return signatures_reply(message, split, cohort.task.modality, _site(context).dedup_key)


@client_app.query("dedup_drop")
def dedup_drop(message: Message, context: Context) -> Message:
    _, split = all_site_data(_run_config(context), context)
    return drop_reply(message, context, len(split.train_y))


@client_app.query("stats")
def cohort_stats(message: Message, context: Context) -> Message:
    """The site's raw counts (`site_stats`); its policy releases them (`SitePolicy.release`). A site with its
    own file counts the file's raw values, not the standardised ones it trains on."""
    cfg, site = _run_config(context), _site(context)
    if site.data_path is not None:
        task, x, y = read_dataset(site.data_path, site.label_column or None)
    else:
        cohort, split = site_data(cfg, context)
        task = cohort.task
        x = torch.cat([split.train_x, split.test_x]).numpy()
        y = torch.cat([split.train_y, split.test_y]).numpy()
    record = ConfigRecord({protocol.STATS_REPORT: site_stats(task, x, y, cfg).to_json()})
    return Message(RecordDict({protocol.STATS_RECORD: record}), reply_to=message)


@client_app.query("curvature")
def curvature(message: Message, context: Context) -> Message:
    cfg = _run_config(context)
    cohort, split = site_data(cfg, context)
    model = site_model(cohort.task, cfg, _received_arrays(message))
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention kernels have no double backward
        h, v = estimate_curvature(
            model,
            split.train_x[:16],
            split.train_y[:16],
            seed=cfg.seed,
            loss_fn=task_loss(cohort.task),
        )
    metrics = MetricRecord(
        {"curvature": h, "curvature-var": v, protocol.WEIGHT: len(split.train_y)}
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


@client_app.query("scores")
def scores(message: Message, context: Context) -> Message:
    """Layer importance (`layer-L`) and head importance (`head-L-G`, per KV group) on a few of the site's
    training batches (or, asked for `magnitude` in a private run, from the model's weights alone), with the
    site's tier, its measured step cost (`subnet.measure.measure_layer_cost`) and declared memory, and the
    model's slice layout (see `slice_layout`)."""
    cfg, request = _run_config(context), message_keys(message)
    cohort, split = site_data(cfg, context)
    model = site_model(cohort.task, cfg, _received_arrays(message))
    n = min(int(request[protocol.SCORE_SAMPLES]), len(split.train_y))
    size = cfg.batch_size
    batches = [
        (split.train_x[i : min(i + size, n)], split.train_y[i : min(i + size, n)])
        for i in range(0, n, size)
    ]
    layer_method, head_method = (
        str(request[protocol.LAYER_SCORE]),
        str(request[protocol.HEAD_SCORE]),
    )
    magnitude = protocol.MAGNITUDE_SCORE
    from_weights = (
        weight_magnitude(model) if magnitude in (layer_method, head_method) else None
    )  # reads no data
    layers = (
        from_weights[0]
        if from_weights and layer_method == magnitude
        else layer_importance(model, batches, task_loss(cohort.task), method=layer_method)
    )
    heads = (
        from_weights[1]
        if from_weights and head_method == magnitude
        else head_importance(model, batches, task_loss(cohort.task), method=head_method)
    )
    memory_bytes = site_memory_mb(cfg, context) * 1e6
    metrics = MetricRecord(
        {
            protocol.WEIGHT: len(split.train_y),
            **{f"{protocol.LAYER_PREFIX}{layer}": score for layer, score in enumerate(layers)},
            **{
                f"{protocol.HEAD_PREFIX}{layer}-{g}": score
                for layer, row in enumerate(heads)
                for g, score in enumerate(row)
            },
            **expert_scores(model, batches, private=layer_method == magnitude),
            protocol.MEMORY_BYTES: memory_bytes,
        }
    )
    if (
        memory_bytes or cfg.round_timeout_s
    ):  # the cost sizes a Hydra-net or a rank to memory or a deadline
        sample = slice(
            0, min(cfg.batch_size, len(split.train_y))
        )  # a training batch, as `train` has
        batch = (split.train_x[sample], split.train_y[sample])
        speed = site_speed(cfg, context)
        metrics.update(step_costs(cfg, cohort.task, model, batch, speed=speed, request=request))
    site = ConfigRecord({protocol.TIER: site_tier(cfg, context), **slice_layout(model)})
    return Message(RecordDict({"metrics": metrics, protocol.SITE_RECORD: site}), reply_to=message)


def site_tier(cfg: RunConfig, context: Context) -> str:
    """The resource tier a site declares: its node_config `tier`, else its entry of the run's `site_tiers`
    (simulation), else "" (untiered)."""
    site = _site(context)
    if site.tier:
        return site.tier
    tiers = cfg.tier_list
    return tiers[site.index % len(tiers)] if tiers else ""


def site_memory_mb(cfg: RunConfig, context: Context) -> float:
    """The training memory a site declares (0 = no limit): its own (`hydrafl site --memory-mb`), else its entry
    of the run's `site_memory_mb` (simulation), else no limit."""
    site = _site(context)
    if site.memory_mb is not None:
        return site.memory_mb
    return _entry(cfg.memory_list, site.index, 0.0)


def site_speed(cfg: RunConfig, context: Context) -> float:
    """A site's relative speed (1.0 = as measured): its node_config `speed`, else its entry of the run's
    `site_speeds` (simulation), else 1.0."""
    site = _site(context)
    if site.speed is not None:
        return site.speed
    return _entry(cfg.speed_list, site.index, 1.0)


def _entry(values: tuple[float, ...], index: int, default: float) -> float:
    """Site `index`'s entry of a per-site run setting, cycled over the sites; `default` when it is empty."""
    return values[index % len(values)] if values else default
