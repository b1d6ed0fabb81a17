"""Cross-entropy and KL(teacher || student) from hidden states and the LM head, without [N, V] logits.

A causal LM's loss is usually `F.cross_entropy(h @ W.T, y)`: at N = 2048 rows and V = 128k that is a 1 GiB
logits tensor, and its softmax gradient another. Here the logits only ever exist one block of
`window_size` rows x `chunk_size` vocabulary entries at a time (peak extra memory O(window x chunk)), and the
backward pass recomputes each block instead of keeping it (DisaggKD-style).

Each row's softmax is reduced to a few per-row numbers that merge exactly across vocabulary chunks and
across vocabulary shards (a log-sum-exp reduction):

    cross-entropy   max m, sum-exp Z = sum_v e^(z_v - m), target logit z_y     -> loss = m + log Z - z_y
    KL(p || q)      teacher m, Z, C = sum_v e^(t_v - m) (t_v - s_v), student m', Z'
                    -> KL = C / Z - (m + log Z) + (m' + log Z')

(C is the research note's A - B kept as one sum.) The maxima are stabilisers: the merged value does not depend
on them, so they carry no gradient, and autograd through the merge gives each shard the exact gradient of the
full-vocabulary loss: softmax - onehot for cross-entropy, q - p for KL (divide the hidden states by a
temperature T before the call for distillation at temperature T).

A vocabulary-sharded run computes `*_shard_stats` on its own slice of the head weight, gathers every rank's
stats with `gather_shard_stats` (a few floats per row per shard, differentiable) and merges them with
`merge_*_stats`; the in-process `num_shards` argument does exactly that with tensor slices.
The mean divides by the number of valid tokens; pass `num_valid` (the all-reduced count) when the rows are
split over data-parallel ranks, so that every rank divides by the same global count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 8192
DEFAULT_WINDOW_SIZE = 1024


StatsT = TypeVar("StatsT", "CrossEntropyStats", "KLStats")


class CrossEntropyStats(NamedTuple):
    """Per-row partial softmax of one vocabulary shard (or, merged, of the whole vocabulary)."""

    max: Tensor  # [N] row max of the shard's logits (a stabiliser: no gradient)
    sumexp: Tensor  # [N] sum_v exp(z_v - max)
    target: Tensor  # [N] the target's logit where the target is in this shard, else 0


class KLStats(NamedTuple):
    """Per-row partial sums for KL(teacher || student) over one vocabulary shard (or the whole vocabulary)."""

    student_max: Tensor  # [N] m'
    student_sumexp: Tensor  # [N] Z' = sum_v exp(s_v - m')
    teacher_max: Tensor  # [N] m (no gradient: the teacher is a fixed signal)
    teacher_sumexp: Tensor  # [N] Z = sum_v exp(t_v - m)
    teacher_gap: Tensor  # [N] C = sum_v exp(t_v - m) (t_v - s_v)


def _blocks(
    rows: int, vocab: int, window_size: int, chunk_size: int
) -> Iterator[tuple[slice, slice]]:
    for r0 in range(0, rows, window_size):
        for c0 in range(0, vocab, chunk_size):
            yield slice(r0, min(r0 + window_size, rows)), slice(c0, min(c0 + chunk_size, vocab))


def _accumulation_dtype(tensor: Tensor) -> torch.dtype:
    """At least float32 for exp/sum, whatever the input precision (bf16 sums would drift)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _logits(hidden: Tensor, weight: Tensor, rows: slice, cols: slice) -> Tensor:
    return (hidden[rows] @ weight[cols].T).to(_accumulation_dtype(hidden))  # [w, c]


def _target_in_chunk(local_target: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """(row has its target in `cols` [w], the target's column in the chunk, clamped into range [w, 1])."""
    inside = (local_target >= cols.start) & (local_target < cols.stop)
    column = (local_target - cols.start).clamp(0, cols.stop - cols.start - 1).unsqueeze(1)
    return inside, column


class _CrossEntropyShard(torch.autograd.Function):
    """hidden [N, D], weight [V_s, D], local_target [N] -> CrossEntropyStats of this shard, block by block."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        local_target: Tensor,
        chunk_size: int,
        window_size: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        rows, acc = hidden.shape[0], _accumulation_dtype(hidden)
        row_max = torch.full((rows,), -torch.inf, dtype=acc, device=hidden.device)  # [N]
        sumexp = torch.zeros(rows, dtype=acc, device=hidden.device)  # [N]
        target = torch.zeros(rows, dtype=acc, device=hidden.device)  # [N]
        for r, c in _blocks(rows, weight.shape[0], window_size, chunk_size):
            z = _logits(hidden, weight, r, c)  # [w, c]
            inside, column = _target_in_chunk(local_target[r], c)
            target[r] += torch.where(inside, z.gather(1, column).squeeze(1), 0.0)
            new_max = torch.maximum(row_max[r], z.amax(dim=1))  # [w]
            exp_z = z.sub_(
                new_max[:, None]
            ).exp_()  # [w, c] e^(z - m), in place: one block alive at a time
            sumexp[r] = sumexp[r] * torch.exp(row_max[r] - new_max) + exp_z.sum(dim=1)
            row_max[r] = new_max
        ctx.save_for_backward(hidden, weight, local_target, row_max)
        ctx.chunk_size, ctx.window_size = chunk_size, window_size
        ctx.mark_non_differentiable(row_max)
        return row_max, sumexp, target

    @staticmethod
    def backward(
        ctx: Any, _grad_max: Tensor, grad_sumexp: Tensor, grad_target: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, local_target, row_max = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None  # [N, D]
        grad_weight = torch.zeros_like(weight) if want_weight else None  # [V_s, D]
        for r, c in _blocks(hidden.shape[0], weight.shape[0], ctx.window_size, ctx.chunk_size):
            # dL/dz = dL/dZ * e^(z - m) + dL/dz_y * onehot(y), from the recomputed logits, in place
            grad_z = (
                _logits(hidden, weight, r, c)
                .sub_(row_max[r, None])
                .exp_()
                .mul_(grad_sumexp[r, None])
            )  # [w, c]
            inside, column = _target_in_chunk(local_target[r], c)
            grad_z.scatter_add_(1, column, torch.where(inside, grad_target[r], 0.0).unsqueeze(1))
            grad_z = grad_z.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[r] += grad_z @ weight[c]  # [w, D]
            if grad_weight is not None:
                grad_weight[c] += grad_z.T @ hidden[r]  # [c, D]
        return grad_hidden, grad_weight, None, None, None


class _KLShard(torch.autograd.Function):
    """Student (hidden [N, D], weight [V_s, D]) and teacher (hidden [N, D_t], weight [V_s, D_t]) -> KLStats."""

    @staticmethod
    def forward(
        ctx: Any,
        student_hidden: Tensor,
        student_weight: Tensor,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        chunk_size: int,
        window_size: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        rows, acc, device = (
            student_hidden.shape[0],
            _accumulation_dtype(student_hidden),
            student_hidden.device,
        )
        s_max = torch.full((rows,), -torch.inf, dtype=acc, device=device)  # [N] m'
        s_sumexp = torch.zeros(rows, dtype=acc, device=device)  # [N] Z'
        t_max = torch.full((rows,), -torch.inf, dtype=acc, device=device)  # [N] m
        t_sumexp = torch.zeros(rows, dtype=acc, device=device)  # [N] Z
        t_gap = torch.zeros(rows, dtype=acc, device=device)  # [N] C
        for r, c in _blocks(rows, student_weight.shape[0], window_size, chunk_size):
            s = _logits(student_hidden, student_weight, r, c)  # [w, c]
            t = _logits(teacher_hidden, teacher_weight, r, c).to(acc)  # [w, c]
            gap = t - s  # [w, c]
            new_s_max = torch.maximum(s_max[r], s.amax(dim=1))  # [w]
            exp_s = s.sub_(new_s_max[:, None]).exp_()  # [w, c] e^(s - m'), in place
            s_sumexp[r] = s_sumexp[r] * torch.exp(s_max[r] - new_s_max) + exp_s.sum(dim=1)
            s_max[r] = new_s_max
            new_t_max = torch.maximum(t_max[r], t.amax(dim=1))  # [w]
            rescale = torch.exp(t_max[r] - new_t_max)  # [w]
            exp_t = t.sub_(new_t_max[:, None]).exp_()  # [w, c] e^(t - m), in place
            t_sumexp[r] = t_sumexp[r] * rescale + exp_t.sum(dim=1)
            t_gap[r] = t_gap[r] * rescale + exp_t.mul_(gap).sum(dim=1)
            t_max[r] = new_t_max
        ctx.save_for_backward(
            student_hidden, student_weight, teacher_hidden, teacher_weight, s_max, t_max
        )
        ctx.chunk_size, ctx.window_size = chunk_size, window_size
        ctx.mark_non_differentiable(s_max, t_max, t_sumexp)
        return s_max, s_sumexp, t_max, t_sumexp, t_gap

    @staticmethod
    def backward(
        ctx: Any,
        _g_s_max: Tensor,
        grad_s_sumexp: Tensor,
        _g_t_max: Tensor,
        _g_t_sumexp: Tensor,
        grad_gap: Tensor,
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        student_hidden, student_weight, teacher_hidden, teacher_weight, s_max, t_max = (
            ctx.saved_tensors
        )
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(student_hidden) if want_hidden else None  # [N, D]
        grad_weight = torch.zeros_like(student_weight) if want_weight else None  # [V_s, D]
        for r, c in _blocks(
            student_hidden.shape[0], student_weight.shape[0], ctx.window_size, ctx.chunk_size
        ):
            # dL/ds = dL/dZ' * e^(s - m') - dL/dC * e^(t - m), from the recomputed logits, in place
            s = _logits(student_hidden, student_weight, r, c)  # [w, c]
            t = _logits(teacher_hidden, teacher_weight, r, c).to(s.dtype)  # [w, c]
            grad_s = s.sub_(s_max[r, None]).exp_().mul_(grad_s_sumexp[r, None])
            grad_s = grad_s.sub_(t.sub_(t_max[r, None]).exp_().mul_(grad_gap[r, None])).to(
                student_hidden.dtype
            )
            if grad_hidden is not None:
                grad_hidden[r] += grad_s @ student_weight[c]  # [w, D]
            if grad_weight is not None:
                grad_weight[c] += grad_s.T @ student_hidden[r]  # [c, D]
        return grad_hidden, grad_weight, None, None, None, None


def _check_blocks(hidden: Tensor, weight: Tensor, chunk_size: int, window_size: int) -> None:
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} must be [N, D] and [V, D] with the "
            "same D; flatten [B, T, D] hidden states with .reshape(-1, D) first"
        )
    if weight.shape[0] == 0:
        raise ValueError(
            "the head weight (shard) has no vocabulary rows; use fewer shards than vocabulary entries"
        )
    if chunk_size < 1 or window_size < 1:
        raise ValueError(f"chunk_size={chunk_size} and window_size={window_size} must both be >= 1")


def cross_entropy_shard_stats(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window_size: int = DEFAULT_WINDOW_SIZE,
) -> CrossEntropyStats:
    """Partial softmax of hidden [N, D] against the head shard weight [V_s, D] holding vocab ids from `vocab_start`.

    target [N] holds global vocabulary ids; rows whose target is `ignore_index` or outside this shard get a
    target logit of 0 here (the shard that holds the target supplies it when the stats are merged).
    """
    _check_blocks(hidden, weight, chunk_size, window_size)
    if target.shape != hidden.shape[:1]:
        raise ValueError(
            f"target {tuple(target.shape)} must be [N] = [{hidden.shape[0]}], one id per hidden row"
        )
    local_target = torch.where(
        target == ignore_index, -1, target - vocab_start
    )  # [N], -1: not in this shard
    return CrossEntropyStats(
        *_CrossEntropyShard.apply(hidden, weight, local_target, chunk_size, window_size)
    )


def merge_cross_entropy_stats(shards: Sequence[CrossEntropyStats]) -> CrossEntropyStats:
    """The whole-vocabulary stats from every shard's: one log-sum-exp reduction, differentiable."""
    row_max = torch.stack([s.max for s in shards]).amax(dim=0)  # [N]
    sumexp = sum(
        (s.sumexp * torch.exp(s.max - row_max) for s in shards), torch.zeros_like(row_max)
    )  # [N]
    target = sum((s.target for s in shards), torch.zeros_like(row_max))  # [N]
    return CrossEntropyStats(row_max, sumexp, target)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def gather_shard_stats(stats: StatsT, group: Any = None) -> list[StatsT]:
    """Every rank's stats of its vocabulary shard, in rank order, on every rank of `group`, keeping the graph.

    Every rank then computes the same loss from the merged stats; all_gather's backward sums what each of
    those identical losses sends a shard, so the shard's stats scale their gradient by 1 / world size to get
    the gradient of one loss. A rank's head shard then gets exactly its part of the full head's gradient. Its
    hidden states' gradient is its shard's share: sum it over the group (as a tensor-parallel input region
    does) for the full-vocabulary gradient.
    """
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn

    world = dist.get_world_size(group)
    gathered = [
        dist_nn.all_gather(
            _ScaleGradient.apply(field, 1.0 / world) if field.requires_grad else field, group=group
        )
        for field in stats
    ]
    return [type(stats)(*(field[rank] for field in gathered)) for rank in range(world)]


def _count(valid: Tensor, num_valid: int | Tensor | None) -> Tensor:
    """The normaliser: local valid rows, or the global count; 0 valid tokens give a loss of 0, not NaN."""
    count = valid.sum() if num_valid is None else torch.as_tensor(num_valid, device=valid.device)
    return count.clamp(min=1)


def cross_entropy_from_stats(
    stats: CrossEntropyStats,
    target: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_valid: int | Tensor | None = None,
) -> Tensor:
    """Mean cross-entropy over valid rows from whole-vocabulary stats: mean(m + log Z - z_y)."""
    valid = target != ignore_index  # [N]
    per_row = torch.where(valid, stats.max + torch.log(stats.sumexp) - stats.target, 0.0)  # [N]
    return per_row.sum() / _count(valid, num_valid)


def _shard_bounds(vocab: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) vocabulary ranges whose sizes differ by at most one."""
    if not 1 <= num_shards <= vocab:
        raise ValueError(
            f"num_shards={num_shards} must be between 1 and the vocabulary size {vocab}"
        )
    base, extra = divmod(vocab, num_shards)
    bounds = [i * base + min(i, extra) for i in range(num_shards + 1)]
    return list(pairwise(bounds))


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_valid: int | Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window_size: int = DEFAULT_WINDOW_SIZE,
    num_shards: int = 1,
) -> Tensor:
    """`F.cross_entropy(hidden @ weight.T, target, ignore_index=...)` without the [N, V] logits.

    num_shards > 1 splits the head into vocabulary shards and merges their stats, as a vocab-sharded run does.
    num_valid: the global count of valid targets when rows are split over ranks (default: this call's count).
    """
    vocab = weight.shape[0]
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"target id {int(target[bad][0])} is outside the vocabulary [0, {vocab}); use ids below {vocab} "
            f"or ignore_index={ignore_index} for positions without a target"
        )
    shards = [
        cross_entropy_shard_stats(
            hidden,
            weight[start:stop],
            target,
            vocab_start=start,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            window_size=window_size,
        )
        for start, stop in _shard_bounds(vocab, num_shards)
    ]
    return cross_entropy_from_stats(
        merge_cross_entropy_stats(shards), target, ignore_index=ignore_index, num_valid=num_valid
    )


def kl_shard_stats(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window_size: int = DEFAULT_WINDOW_SIZE,
) -> KLStats:
    """Partial KL sums of one vocabulary shard: student [N, D] x [V_s, D], teacher [N, D_t] x [V_s, D_t].

    The teacher arrives as hidden states plus its own head (a few MB per batch instead of [N, V] logits); it
    is detached, since only the student learns.
    """
    _check_blocks(student_hidden, student_weight, chunk_size, window_size)
    _check_blocks(teacher_hidden, teacher_weight, chunk_size, window_size)
    if (
        teacher_hidden.shape[0] != student_hidden.shape[0]
        or teacher_weight.shape[0] != student_weight.shape[0]
    ):
        raise ValueError(
            f"teacher hidden {tuple(teacher_hidden.shape)} / head {tuple(teacher_weight.shape)} must have the "
            f"student's rows {student_hidden.shape[0]} and vocabulary (shard) size {student_weight.shape[0]}"
        )
    stats = _KLShard.apply(
        student_hidden,
        student_weight,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        chunk_size,
        window_size,
    )
    return KLStats(*stats)


def merge_kl_stats(shards: Sequence[KLStats]) -> KLStats:
    """The whole-vocabulary KL sums from every shard's: Z', Z and C rescaled to the common maxima and summed."""
    s_max = torch.stack([s.student_max for s in shards]).amax(dim=0)  # [N] m'
    t_max = torch.stack([s.teacher_max for s in shards]).amax(dim=0)  # [N] m
    zero = torch.zeros_like(s_max)
    s_sumexp = sum(
        (s.student_sumexp * torch.exp(s.student_max - s_max) for s in shards), zero
    )  # [N] Z'
    t_scale = [torch.exp(s.teacher_max - t_max) for s in shards]  # S x [N]
    t_sumexp = sum(
        (s.teacher_sumexp * k for s, k in zip(shards, t_scale, strict=True)), zero
    )  # [N] Z
    t_gap = sum((s.teacher_gap * k for s, k in zip(shards, t_scale, strict=True)), zero)  # [N] C
    return KLStats(s_max, s_sumexp, t_max, t_sumexp, t_gap)


def kl_from_stats(
    stats: KLStats, valid: Tensor | None = None, *, num_valid: int | Tensor | None = None
) -> Tensor:
    """Mean over valid rows of KL(p || q) = C / Z - (m + log Z) + (m' + log Z')."""
    per_row = (
        stats.teacher_gap / stats.teacher_sumexp
        - (stats.teacher_max + torch.log(stats.teacher_sumexp))
        + (stats.student_max + torch.log(stats.student_sumexp))
    )  # [N]
    valid = torch.ones_like(per_row, dtype=torch.bool) if valid is None else valid
    return torch.where(valid, per_row, 0.0).sum() / _count(valid, num_valid)


def chunked_kl_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    valid: Tensor | None = None,
    num_valid: int | Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window_size: int = DEFAULT_WINDOW_SIZE,
    num_shards: int = 1,
) -> Tensor:
    """Mean over valid rows of KL(softmax(teacher logits) || softmax(student logits)), logits never built.

    valid [N] bool: rows that count (e.g. `target != -100`); default all. num_valid: the global count when rows
    are split over ranks. Equals `F.kl_div(log_softmax(s), log_softmax(t), log_target=True, reduction="none")`
    summed over the vocabulary and averaged over valid rows.
    """
    if valid is not None and (valid.dtype != torch.bool or valid.shape != student_hidden.shape[:1]):
        raise ValueError(
            f"valid mask {valid.dtype} {tuple(valid.shape)} must be torch.bool [N] = [{student_hidden.shape[0]}]; "
            "build it as target != -100"
        )
    shards = [
        kl_shard_stats(
            student_hidden,
            student_weight[start:stop],
            teacher_hidden,
            teacher_weight[start:stop],
            chunk_size=chunk_size,
            window_size=window_size,
        )
        for start, stop in _shard_bounds(student_weight.shape[0], num_shards)
    ]
    return kl_from_stats(merge_kl_stats(shards), valid, num_valid=num_valid)


@torch.no_grad()
def chunked_argmax(
    hidden: Tensor,
    weight: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window_size: int = DEFAULT_WINDOW_SIZE,
) -> Tensor:
    """`(hidden @ weight.T).argmax(-1)` [N] without the [N, V] logits, for token accuracy; a tie between chunks
    keeps the lower id, as torch.argmax does."""
    _check_blocks(hidden, weight, chunk_size, window_size)
    rows = hidden.shape[0]
    best = torch.full(
        (rows,), -torch.inf, dtype=_accumulation_dtype(hidden), device=hidden.device
    )  # [N]
    ids = torch.zeros(rows, dtype=torch.long, device=hidden.device)  # [N]
    for r, c in _blocks(rows, weight.shape[0], window_size, chunk_size):
        value, index = _logits(hidden, weight, r, c).max(dim=1)  # [w], [w]
        better = value > best[r]
        best[r] = torch.where(better, value, best[r])
        ids[r] = torch.where(better, index + c.start, ids[r])
    return ids
