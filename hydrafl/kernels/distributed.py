"""Multi-process local training for one site: N ranks, DistributedDataParallel, elastic deterministic batches.

Every rank reads its share of each global batch from an `ElasticLoader` (world_size = nproc x hosts), so batch k
holds the same samples for any world size that divides the loader's lanes. The ranks' shares are equal (lanes
divide evenly over the ranks and the global batch over the lanes), so each rank's mean loss over its share,
averaged by DDP over the ranks, has exactly the gradient of the mean loss over the global batch: the end state
equals, within float tolerance, what one process computes on the same global batches. `nproc=1` trains in
process, without a process group, and is the reference. A round with more steps than one pass over the data
holds reads further passes (the loader's epochs 1, 2, ...), each a fresh permutation; the data hash covers
every global batch of every pass, in order.

Ranks are started as torchrun starts them: torch.distributed.elastic's agent (`elastic_launch`, one node,
c10d rendezvous on loopback) sets RANK/WORLD_SIZE/MASTER_* and, when a rank dies, restarts the whole group up to
`max_restarts` times. A restart replays the round from the start state on the same global batches (they are a
pure function of seed and round), so it sends the delta an undisturbed run sends. A site on several hosts
starts each host's ranks the same way, into one rendezvous across them (`hydrafl.kernels.multi_host`). Ranks
talk through torch.distributed: gloo on CPU, nccl when the accelerator is CUDA (`pick_device`). The caller's
local rank 0 hands the end state back to it through a file in a temporary directory.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.nn.parallel import DistributedDataParallel

from hydrafl.kernels import multi_host
from hydrafl.kernels.elastic_loader import ElasticLoader, LoaderConfigError, hash_global_batches
from hydrafl.kernels.launch import elastic_run, one_host_config
from hydrafl.kernels.layer_store import check_memory_budget
from hydrafl.kernels.layer_stream import LayerStream, streamed
from hydrafl.kernels.lm_dual import HeadLM
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.kernels.optimizers import inner_optimizer
from hydrafl.losses import LossFn, classification_loss

__all__ = [
    "DistributedResult",
    "DistributedTrainingError",
    "pick_device",
    "process_group_backend",
    "train_distributed",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedResult:
    end_state: dict[str, torch.Tensor]
    """The trained weights, on CPU, with the same keys as the start state."""
    loss: float
    """Mean training loss over the steps (each step's loss is the mean over its whole global batch)."""
    samples: int
    """Samples trained on, over all ranks: steps x global batch size."""
    data_hash: str
    """The loader's round hash: SHA-256 over every global batch's ordered sample ids; equal for any nproc."""
    samples_per_s: float
    """Throughput of the training loop over all ranks (process start-up and model build excluded)."""
    steps: int
    nproc: int
    device: str
    """Device type the ranks trained on ("cpu", "cuda", ...)."""
    device_name: str = ""
    """The accelerator's product name (e.g. "NVIDIA H100 80GB HBM3"); "" on CPU. Keys the peak-FLOP/s table."""
    restarts: int = 0
    """How many times the elastic agent restarted the ranks before this result (a rank had died)."""
    peak_stream_bytes: int = 0
    """With layer streaming: the most bytes of block tensors materialised at once (the window's)."""


class DistributedTrainingError(RuntimeError):
    """A rank died more often than the elastic agent may restart the group."""


def pick_device() -> torch.device:
    """The current accelerator (through `torch.accelerator`) when one is available, else the CPU."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return torch.device(accelerator.type)
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """nccl for CUDA ranks, gloo for everything else (CPU included)."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """Everything a rank needs, picklable for the spawned ranks."""

    build: Callable[[], nn.Module]
    state: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    training: LocalTraining
    """With its steps resolved."""
    device_type: str
    loss_fn: LossFn


def train_distributed(
    build: Callable[[], nn.Module],
    state: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalTraining,
    *,
    device: str | torch.device | None = None,
    loss_fn: LossFn = classification_loss,
) -> DistributedResult:
    """Train `build()` loaded with `state` for `training.steps` global batches of (x, y) on `training.nproc`
    processes (on each of `training.nnodes` hosts).

    `build` must be picklable for nproc > 1 (e.g. `functools.partial(build_model, task)`); with nproc=1 it may
    return a live model, which is trained in place (and moved to the device). `device` defaults to
    `pick_device()`. `loss_fn(model, x, y)` is the task's batch-mean loss (picklable for nproc > 1); it must
    call the model's forward, which is all DDP sees. A rank that dies is restarted `training.max_restarts`
    times before the round fails with `DistributedTrainingError`.
    """
    # Validates lanes, world size, batch size and dataset size before any process starts.
    probe = ElasticLoader(
        len(x),
        global_batch_size=training.batch_size,
        lanes=training.lanes,
        world_size=training.world_size,
        seed=training.seed,
        server_round=training.server_round,
    )
    if training.steps is None:
        if probe.steps_per_round < 1:
            raise LoaderConfigError(
                f"{len(x)} samples hold no global batch of {training.batch_size}"
            )
        training = replace(training, steps=probe.steps_per_round)
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)}")
    device_type = torch.device(device).type if device is not None else pick_device().type
    job = _Job(
        build=build,
        state={  # the caller's stay unshared
            name: tensor.detach().cpu().clone() for name, tensor in state.items()
        },
        x=x,
        y=y,
        training=training,
        device_type=device_type,
        loss_fn=loss_fn,
    )
    nproc, max_restarts = training.nproc, training.max_restarts
    if training.world_size == 1:
        return _run_rank(job, rank=0, model_wrapper=None)
    if device_type == "cuda" and nproc > torch.accelerator.device_count():
        raise ValueError(
            f"nproc={nproc} exceeds the {torch.accelerator.device_count()} CUDA devices"
        )
    with tempfile.TemporaryDirectory(prefix="hydrafl-ddp-") as tmp:
        logs = Path(tmp) / "logs"  # gone with the round
        announcement = None
        if training.nnodes > 1:
            announcement = multi_host.RoundAnnouncement(training.rdzv)
            launch = multi_host.launch_config(
                nnodes=training.nnodes,
                nproc=nproc,
                run_id=announcement.run_id,
                endpoint=training.rdzv,
                max_restarts=max_restarts,
                log_dir=logs,
            )
        else:
            launch = one_host_config(nproc=nproc, max_restarts=max_restarts, log_dir=logs)
        out = Path(tmp) / "rank0.pt"
        try:
            elastic_run(launch, _rank_main, job, str(out))
        except ChildFailedError as error:
            raise DistributedTrainingError(
                f"{training.world_size} training processes failed after {max_restarts} restart(s): "
                f"{error.format_msg()}"
            ) from error
        finally:
            if announcement is not None:
                announcement.done()
        payload = torch.load(out, weights_only=True)
    return DistributedResult(**payload)


def run_round_on_this_host(
    run_id: str, *, nnodes: int, nproc: int, endpoint: str, max_restarts: int
) -> None:
    """This host's `nproc` ranks of a round the site's leader announced as `run_id`; the job comes from the
    leader's ranks, and the result goes back through them."""
    with tempfile.TemporaryDirectory(prefix="hydrafl-ddp-") as tmp:
        launch = multi_host.launch_config(
            nnodes=nnodes,
            nproc=nproc,
            run_id=run_id,
            endpoint=endpoint,
            max_restarts=max_restarts,
            log_dir=Path(tmp) / "logs",
        )
        try:
            elastic_run(launch, _rank_main, None, None)
        except ChildFailedError as error:
            raise DistributedTrainingError(
                f"{nproc} training processes on this host failed after {max_restarts} restart(s): "
                f"{error.format_msg()}"
            ) from error


def _rank_main(job: _Job | None, out: str | None) -> None:
    """Entry point of a rank started by the elastic agent (RANK, WORLD_SIZE, MASTER_* in the environment): join
    the process group, take the job from the leader's ranks when this host has none, train; the leader's local
    rank 0 writes the result to `out`."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = _rank_device(job.device_type if job else pick_device().type, local_rank)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=rank == 0
    )
    dist.init_process_group(
        process_group_backend(device),
        store=store,
        rank=rank,
        world_size=world_size,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    try:
        job = _job_from_leader(job, device)
        # Share the host's cores between its ranks instead of oversubscribing them.
        torch.set_num_threads(max(1, (job.training.threads or os.cpu_count() or 1) // local_world))

        def wrap(model: nn.Module) -> nn.Module:
            # Some parameters get no gradient (e.g. word embeddings of an encoder fed `inputs_embeds`).
            return DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=True,
            )

        result = _run_rank(job, rank=rank, model_wrapper=wrap)
        # the most restarts any host's agent made (a host whose rank died counts one; the others may not)
        restarts = torch.tensor(int(os.environ["TORCHELASTIC_RESTART_COUNT"]), device=device)
        dist.all_reduce(restarts, op=dist.ReduceOp.MAX)
        if out is not None and local_rank == 0:
            result = replace(result, restarts=int(restarts))
            torch.save({field.name: getattr(result, field.name) for field in fields(result)}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _job_from_leader(job: _Job | None, device: torch.device) -> _Job:
    """The round's job: this rank's own on the leader's host; on another host, broadcast from a leader's rank."""
    if int(os.environ["GROUP_WORLD_SIZE"]) == 1:
        assert job is not None
        return job
    holders: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(holders, job is not None)
    box = [job]
    dist.broadcast_object_list(box, src=holders.index(True))
    received = box[0]
    assert received is not None
    if received.training.world_size != dist.get_world_size():
        raise ValueError(
            f"the site's leader trains on {received.training.world_size} processes but "
            f"{dist.get_world_size()} joined: start every host with the same --nproc"
        )
    if received.device_type != device.type:
        raise ValueError(
            f"the site's leader trains on {received.device_type}, this host on {device.type}"
        )
    return received


def _rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    index = local_rank % max(1, torch.accelerator.device_count())
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def _run_rank(
    job: _Job, *, rank: int, model_wrapper: Callable[[nn.Module], nn.Module] | None
) -> DistributedResult:
    """Train this rank's model on its share of every global batch; the whole loop for nproc == 1."""
    device = _rank_device(job.device_type, int(os.environ.get("LOCAL_RANK", 0)))
    model = job.build()
    _load_start_state(model, job.state)
    training = job.training
    window = training.window if training.stream_layers else None
    check_memory_budget(model, training.optimizer, training.memory_budget_bytes, window)
    loaders: list[ElasticLoader] = []
    with streamed(model, training, device) if window else nullcontext() as stream:
        model.to(device)  # with streaming, the blocks are in the store already: only the rest moves
        loss_sum, elapsed = _train_steps(job, model, device, rank, model_wrapper, stream, loaders)
    samples = job.training.steps * job.training.batch_size
    model_state = model.state_dict()
    end_state = {name: model_state[name].detach().cpu().clone() for name in job.state}
    return DistributedResult(
        end_state=end_state,
        loss=float(loss_sum) / job.training.steps,
        samples=samples,
        data_hash=hash_global_batches(
            loader.global_batch(step) for loader in loaders for step in range(loader.step)
        ),
        samples_per_s=samples / elapsed if elapsed > 0 else math.inf,
        steps=job.training.steps,
        nproc=job.training.world_size,
        device=device.type,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        peak_stream_bytes=stream.peak_resident_bytes if stream is not None else 0,
    )


def _train_steps(
    job: _Job,
    model: nn.Module,
    device: torch.device,
    rank: int,
    model_wrapper: Callable[[nn.Module], nn.Module] | None,
    stream: LayerStream | None,
    loaders: list[ElasticLoader],
) -> tuple[torch.Tensor, float]:
    """The training loop: (summed step losses, seconds it took)."""
    trained = model_wrapper(model) if model_wrapper is not None else model
    head_lm = HeadLM(model, model.head()) if job.training.optimizer == "lm-dual" else None  # type: ignore[operator]
    streamed = stream.parameters() if stream is not None else set()
    optimizer = (
        None
        if head_lm
        else inner_optimizer(
            [(n, p) for n, p in model.named_parameters() if p.requires_grad and p not in streamed],
            job.training.optimizer,
            lr=job.training.lr,
            weight_decay=job.training.weight_decay,
        )
    )
    world_size = job.training.world_size
    local_size = job.training.batch_size // world_size
    if local_size * world_size != job.training.batch_size:
        raise LoaderConfigError(
            f"global batch {job.training.batch_size} does not split evenly over "
            f"{world_size} ranks; the DDP mean would not be the global mean"
        )
    trained.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    if model_wrapper is not None:
        dist.barrier()
    start = time.perf_counter()
    for ids in _rank_batches(job, rank, loaders):
        if len(ids) != local_size:
            raise LoaderConfigError(f"rank {rank} got {len(ids)} samples, expected {local_size}")
        idx = torch.as_tensor(ids, dtype=torch.long)
        xb, yb = job.x[idx].to(device, non_blocking=True), job.y[idx].to(device, non_blocking=True)
        if head_lm is not None:
            loss_sum += head_lm.step(xb, yb)
            continue
        optimizer.zero_grad()
        # Equal shares: the mean over the ranks (DDP's gradient average) of each share's mean is the global mean
        # (a loss over a varying number of valid tokens rescales its share itself, see `hydrafl.causal_lm`).
        with _autocast(device, job.training.bf16):
            loss = job.loss_fn(trained, xb, yb)
        loss_sum += loss.detach().double().cpu()
        loss.backward()
        if stream is not None:
            stream.step(optimizer)
        else:
            optimizer.step()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    if model_wrapper is not None:
        loss_sum = loss_sum.to(device)
        dist.all_reduce(
            loss_sum
        )  # sum over ranks of the share means: nproc x the global mean, per step
        loss_sum = loss_sum.cpu() / world_size
    return loss_sum, time.perf_counter() - start


def _rank_batches(job: _Job, rank: int, loaders: list[ElasticLoader]) -> Iterator[list[int]]:
    """This rank's share of each of the job's `steps` global batches, pass after pass; every pass's loader is
    appended to `loaders` (for the data hash)."""
    emitted = 0
    for epoch in itertools.count():
        loader = ElasticLoader(
            len(job.x),
            global_batch_size=job.training.batch_size,
            lanes=job.training.lanes,
            world_size=job.training.world_size,
            rank=rank,
            seed=job.training.seed,
            server_round=job.training.server_round,
            epoch=epoch,
        )
        loaders.append(loader)
        for ids in loader:
            yield ids
            emitted += 1
            if emitted == job.training.steps:
                return


def _autocast(device: torch.device, enabled: bool) -> AbstractContextManager[Any]:
    if not enabled:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _load_start_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` (all of the model's trainable parameters, optionally buffers and frozen ones)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise KeyError(f"the start state has keys the model lacks: {sorted(unexpected)[:5]}")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    lacking = sorted(trainable & set(missing))
    if lacking:
        raise KeyError(f"the start state lacks trainable parameters: {lacking[:5]}")
