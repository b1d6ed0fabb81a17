"""The chunked, vocabulary-sharded loss equals the full-logits loss, in value and gradient, and never builds [N, V]."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from spawned_ranks import vocab_sharded_rank

from hydrafl.kernels.chunked_loss import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    chunked_kl_divergence,
    cross_entropy_shard_stats,
    merge_cross_entropy_stats,
)
from hydrafl.kernels.launch import free_port

N, D, D_TEACHER, V = 37, 16, 12, 101
SETTINGS = [
    (1, 8192, 1024),
    (1, 7, 5),
    (3, 7, 5),
    (4, 16, 37),
    (5, 1, 1),
    (2, 101, 2),
]  # (shards, chunk, window)


def problem(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (N,), generator=gen)
    target[::5] = IGNORE_INDEX
    return {
        "hidden": torch.randn(N, D, generator=gen, dtype=dtype).requires_grad_(),
        "weight": (0.3 * torch.randn(V, D, generator=gen, dtype=dtype)).requires_grad_(),
        "teacher_hidden": torch.randn(N, D_TEACHER, generator=gen, dtype=dtype),
        "teacher_weight": 0.3 * torch.randn(V, D_TEACHER, generator=gen, dtype=dtype),
        "target": target,
    }


def grads(loss: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize(("shards", "chunk", "window"), SETTINGS)
def test_cross_entropy_equals_full_vocabulary(shards: int, chunk: int, window: int) -> None:
    p = problem()
    full = F.cross_entropy(p["hidden"] @ p["weight"].T, p["target"])
    ours = chunked_cross_entropy(
        p["hidden"],
        p["weight"],
        p["target"],
        num_shards=shards,
        chunk_size=chunk,
        window_size=window,
    )
    assert abs(ours.item() - full.item()) <= 1e-6
    for mine, theirs in zip(
        grads(ours, p["hidden"], p["weight"]), grads(full, p["hidden"], p["weight"]), strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("shards", "chunk", "window"), SETTINGS)
def test_kl_equals_kl_div_over_valid_rows(shards: int, chunk: int, window: int) -> None:
    p = problem()
    valid = p["target"] != IGNORE_INDEX
    student = F.log_softmax(p["hidden"] @ p["weight"].T, dim=-1)
    teacher = F.log_softmax(p["teacher_hidden"] @ p["teacher_weight"].T, dim=-1)
    full = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)[valid].mean()
    ours = chunked_kl_divergence(
        p["hidden"],
        p["weight"],
        p["teacher_hidden"],
        p["teacher_weight"],
        valid=valid,
        num_shards=shards,
        chunk_size=chunk,
        window_size=window,
    )
    assert abs(ours.item() - full.item()) <= 1e-6
    for mine, theirs in zip(
        grads(ours, p["hidden"], p["weight"]), grads(full, p["hidden"], p["weight"]), strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shards", [1, 3])
def test_gradcheck_float64(shards: int) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    teacher_weight = torch.randn(11, 2, generator=gen, dtype=torch.float64)
    target = torch.tensor([0, 10, IGNORE_INDEX, 4, 5, 7])
    blocks = {"num_shards": shards, "chunk_size": 3, "window_size": 4}

    def cross_entropy(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(h, w, target, **blocks)

    def kl(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return chunked_kl_divergence(
            h, w, teacher_hidden, teacher_weight, valid=target != IGNORE_INDEX, **blocks
        )

    assert torch.autograd.gradcheck(cross_entropy, (hidden, weight))
    assert torch.autograd.gradcheck(kl, (hidden, weight))


def test_merged_shard_stats_are_the_full_log_sum_exp_and_target_logit() -> None:
    p = problem()
    hidden, weight, target = p["hidden"].detach(), p["weight"].detach(), p["target"]
    bounds = [0, 10, 11, 60, V]
    shards = [
        cross_entropy_shard_stats(
            hidden, weight[a:b], target, vocab_start=a, chunk_size=8, window_size=16
        )
        for a, b in itertools.pairwise(bounds)
    ]
    merged = merge_cross_entropy_stats(shards)
    logits = hidden @ weight.T
    valid = target != IGNORE_INDEX
    torch.testing.assert_close(
        merged.max + merged.sumexp.log(), logits.logsumexp(-1), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        merged.target[valid], logits[valid, target[valid]], atol=1e-6, rtol=0
    )
    assert torch.all(merged.target[~valid] == 0)


def test_global_count_normalises_across_ranks() -> None:
    """Rows split over two 'ranks', each dividing by the all-reduced count: the sum is the full mean."""
    p = problem()
    full = F.cross_entropy(p["hidden"] @ p["weight"].T, p["target"])
    count = int((p["target"] != IGNORE_INDEX).sum())
    halves = [slice(0, 10), slice(10, N)]
    total = sum(
        chunked_cross_entropy(
            p["hidden"][rows], p["weight"], p["target"][rows], num_valid=count, chunk_size=16
        )
        for rows in halves
    )
    assert abs(total.item() - full.item()) <= 1e-6
    for mine, theirs in zip(
        grads(total, p["hidden"], p["weight"]), grads(full, p["hidden"], p["weight"]), strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


def test_a_frozen_head_and_the_teacher_get_no_gradient() -> None:
    p = problem()
    weight = p["weight"].detach()
    teacher_hidden = p["teacher_hidden"].requires_grad_()
    full = F.cross_entropy(p["hidden"] @ weight.T, p["target"])
    ours = chunked_cross_entropy(p["hidden"], weight, p["target"], chunk_size=16, window_size=8)
    torch.testing.assert_close(
        grads(ours, p["hidden"])[0], grads(full, p["hidden"])[0], atol=1e-6, rtol=1e-5
    )
    kl = chunked_kl_divergence(
        p["hidden"], weight, teacher_hidden, p["teacher_weight"], chunk_size=16
    )
    kl.backward()
    assert p["hidden"].grad is not None and teacher_hidden.grad is None


def test_only_ignored_targets_give_zero_loss_and_zero_gradient() -> None:
    p = problem()
    loss = chunked_cross_entropy(
        p["hidden"], p["weight"], torch.full((N,), IGNORE_INDEX), chunk_size=16
    )
    assert loss.item() == 0.0
    assert all(torch.all(g == 0) for g in grads(loss, p["hidden"], p["weight"]))


def test_bfloat16_inputs_accumulate_in_float32() -> None:
    p = problem()
    hidden, weight = p["hidden"].detach().bfloat16(), p["weight"].detach().bfloat16()
    loss = chunked_cross_entropy(hidden, weight, p["target"], chunk_size=16, window_size=8)
    reference = F.cross_entropy(hidden.float() @ weight.float().T, p["target"])
    assert loss.dtype == torch.float32
    assert abs(loss.item() - reference.item()) < 2e-2


def test_never_materialises_the_logits(largest_tensor) -> None:
    rows, dim, vocab, window, chunk = 128, 4, 512, 16, 64
    hidden = torch.randn(rows, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(rows, dim), torch.randn(vocab, dim)
    target = torch.randint(0, vocab, (rows,))
    with largest_tensor as largest:
        chunked_cross_entropy(
            hidden, weight, target, chunk_size=chunk, window_size=window, num_shards=2
        ).backward()
        chunked_kl_divergence(
            hidden, weight, teacher_hidden, teacher_weight, chunk_size=chunk, window_size=window
        ).backward()
    # the biggest things alive are the head and its gradient [V, D]; a window x chunk block is 1024, the logits 65536
    assert largest.numel <= max(vocab * dim, window * chunk) < rows * vocab // 16


def test_errors_name_the_bad_value() -> None:
    p = problem()
    hidden, weight = p["hidden"], p["weight"]
    with pytest.raises(ValueError, match=f"target id {V} is outside the vocabulary"):
        chunked_cross_entropy(hidden, weight, torch.full((N,), V))
    with pytest.raises(ValueError, match="same D"):
        chunked_cross_entropy(hidden, weight[:, :3], p["target"])
    with pytest.raises(ValueError, match="target .* must be \\[N\\]"):
        chunked_cross_entropy(hidden, weight, p["target"][:3])
    with pytest.raises(ValueError, match=f"num_shards={V + 1}"):
        chunked_cross_entropy(hidden, weight, p["target"], num_shards=V + 1)
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_cross_entropy(hidden, weight, p["target"], chunk_size=0)
    with pytest.raises(ValueError, match="valid mask"):
        chunked_kl_divergence(
            hidden, weight, p["teacher_hidden"], p["teacher_weight"], valid=p["target"]
        )
    with pytest.raises(ValueError, match="teacher hidden"):
        chunked_kl_divergence(hidden, weight, p["teacher_hidden"][:5], p["teacher_weight"])


VOCAB_SPLIT = (0, 40, V)  # rank 0 holds ids [0, 40) of the head, rank 1 [40, 101)


@pytest.mark.slow
def test_vocabulary_shards_on_two_ranks_give_the_full_loss_and_gradients(tmp_path: Path) -> None:
    p = problem()
    mp.spawn(
        vocab_sharded_rank, args=(free_port(), str(tmp_path), p, VOCAB_SPLIT), nprocs=2, join=True
    )
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    full = F.cross_entropy(p["hidden"] @ p["weight"].T, p["target"]) + chunked_kl_divergence(
        p["hidden"], p["weight"], p["teacher_hidden"], p["teacher_weight"]
    )
    hidden_grad, weight_grad = grads(full, p["hidden"], p["weight"])
    for result in ranks:  # every rank computes the same, full-vocabulary loss
        assert abs(result["loss"].item() - full.item()) <= 1e-6
    # each head shard gets exactly its rows of the full head's gradient; the hidden states' shares sum to theirs
    torch.testing.assert_close(
        torch.cat([r["weight"] for r in ranks]), weight_grad, atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        ranks[0]["hidden"] + ranks[1]["hidden"], hidden_grad, atol=1e-6, rtol=1e-5
    )
    assert (
        float(ranks[0]["hidden"].sub(hidden_grad).abs().max()) > 1e-3
    )  # one shard's share is not the whole
