"""The causal LM behind next-token tasks: the Llama-style model of `backbones`, trained through the chunked
vocabulary loss kernel so that [B, T, V] logits never exist, in training or in evaluation.

`CausalLM.forward(x)` returns the final hidden states; `forward(x, labels=y)` returns the mean next-token
cross-entropy over valid targets (plus `distill_weight` x KL(teacher || student) when a teacher signal is
given). The loss lives in `forward` because DistributedDataParallel only syncs gradients of what runs there.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hydrafl.backbones import (
    LoraSpec,
    TinyShape,
    build_causal_lm,
    build_moe_lm,
    load_pretrained,
    with_lora,
)
from hydrafl.catalog import MOE_MODEL
from hydrafl.data import TaskSpec
from hydrafl.data.notes_lm_cohort import IGNORE_INDEX
from hydrafl.kernels.chunked_loss import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_WINDOW_SIZE,
    chunked_argmax,
    chunked_cross_entropy,
    chunked_kl_divergence,
)

__all__ = ["CausalLM", "DistillationError", "build_lm", "build_teacher"]

TEACHER_INIT = "init"
"""`distill_teacher` value for a frozen copy of the seeded initial model (a smoke-test teacher)."""


class DistillationError(ValueError):
    """A teacher that cannot teach this student (e.g. another vocabulary); the message says how to fix it."""


class CausalLM(nn.Module):
    """A decoder-only LM (plain or PEFT-wrapped) behind the hidden-states + LM-head interface. `chunk_size`
    vocabulary entries x `window_size` rows is the largest logits block the loss kernel ever holds."""

    def __init__(
        self,
        net: nn.Module,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        window_size: int = DEFAULT_WINDOW_SIZE,
    ) -> None:
        super().__init__()
        self.net = net
        self.chunk_size, self.window_size = chunk_size, window_size
        head = self._lm().get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError(
                f"{type(self._lm()).__name__} has no bias-free LM head; a causal-LM checkpoint is needed"
            )

    def _lm(self) -> nn.Module:
        """The transformers causal LM under any PEFT wrapper (PEFT injects LoRA into its modules in place)."""
        get_base = getattr(self.net, "get_base_model", None)
        return get_base() if get_base is not None and hasattr(self.net, "peft_config") else self.net

    @property
    def _blocks(self) -> dict[str, int]:
        return {"chunk_size": self.chunk_size, "window_size": self.window_size}

    @property
    def head_weight(self) -> Tensor:
        """The LM head weight [V, D]."""
        return self._lm().get_output_embeddings().weight

    def hidden_states(self, x: Tensor) -> Tensor:
        """Final hidden states [B, T, D] of token ids x [B, T]. Padding is on the right, so under causal
        attention no real token ever sees it and no attention mask is needed."""
        return self._lm().base_model(input_ids=x, use_cache=False).last_hidden_state

    def forward(
        self,
        x: Tensor,
        labels: Tensor | None = None,
        teacher: tuple[Tensor, Tensor] | None = None,
        distill_weight: float = 0.0,
    ) -> Tensor:
        """Hidden states [B, T, D] without `labels`; with labels [B, T] the training loss (a scalar)."""
        hidden = self.hidden_states(x)  # [B, T, D]
        if labels is None:
            return hidden
        valid = labels.reshape(-1) != IGNORE_INDEX  # [B*T]
        target = labels.reshape(-1)[valid]  # [N]
        h = hidden.reshape(-1, hidden.shape[-1])[
            valid
        ].float()  # [N, D], only the rows that have a target
        weight = self.head_weight.float()  # [V, D]
        count = _valid_count(valid) if self.training else None
        with torch.autocast(
            h.device.type, enabled=False
        ):  # the kernel accumulates in float32 itself
            loss = chunked_cross_entropy(h, weight, target, num_valid=count, **self._blocks)
            if teacher is not None and distill_weight:
                t_hidden, t_weight = teacher
                if t_weight.shape[0] != weight.shape[0]:
                    raise DistillationError(
                        f"the teacher's vocabulary has {t_weight.shape[0]} entries, the student's {weight.shape[0]}; "
                        "distillation compares distributions over the same token ids, so use a teacher with the "
                        "student's tokenizer"
                    )
                t_h = t_hidden.reshape(-1, t_hidden.shape[-1])[valid].float()  # [N, D_t]
                kl = chunked_kl_divergence(
                    h, weight, t_h, t_weight.float(), num_valid=count, **self._blocks
                )
                loss = loss + distill_weight * kl
        return loss

    @torch.no_grad()
    def signal(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """What a teacher sends instead of logits: hidden states [B, T, D] and its head weight [V, D]."""
        self.to(x.device)  # a no-op after the first batch
        return self.hidden_states(x), self.head_weight

    @torch.no_grad()
    def evaluation_sums(self, x: Tensor, y: Tensor) -> tuple[float, int, int]:
        """(summed next-token cross-entropy, correct argmax predictions, valid targets); argmax chunk by chunk."""
        valid = y.reshape(-1) != IGNORE_INDEX
        target = y.reshape(-1)[valid]
        hidden = self.hidden_states(x)
        h = hidden.reshape(-1, hidden.shape[-1])[valid].float()
        weight = self.head_weight.float()
        count = int(valid.sum())
        loss_sum = float(chunked_cross_entropy(h, weight, target, **self._blocks)) * count
        correct = int((chunked_argmax(h, weight, **self._blocks) == target).sum())
        return loss_sum, correct, count


def _valid_count(valid: Tensor) -> Tensor | None:
    """Under DDP, this rank's share of the global count of valid targets (global / world size): DDP averages
    the ranks' gradients, so dividing each rank's sum by it gives the gradient of the global token mean even
    when ranks hold different numbers of padded positions. None (the local count) outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    count = valid.sum().to(torch.float64)
    dist.all_reduce(count)
    return count / dist.get_world_size()


def build_lm(
    task: TaskSpec, model: str, shape: TinyShape, seed: int, lora: LoraSpec | None
) -> CausalLM:
    """The next-token task's model: "tiny" (the seeded Llama-style LM, vocabulary from the task's tokenizer),
    "tiny-moe" (its mixture-of-experts sibling, Mixtral family) or a local causal-LM checkpoint (a Mixtral
    checkpoint's experts are selectable too); with `lora` only the LoRA factors train (the LM head stays frozen)."""
    if model in ("tiny", MOE_MODEL):
        sized = replace(shape, max_positions=max(shape.max_positions, task.seq_len))
        build = build_moe_lm if model == MOE_MODEL else build_causal_lm
        net: nn.Module = build(task.vocab_size, shape=sized, seed=seed)
    elif Path(model).is_dir():
        net = load_pretrained(model)
    else:
        raise ValueError(
            f"model {model!r} cannot run next-token task {task.name!r}: use 'tiny', '{MOE_MODEL}' or a local "
            "causal-LM checkpoint directory"
        )
    vocab = (
        net.get_output_embeddings().weight.shape[0]
        if net.get_output_embeddings() is not None
        else 0
    )
    if vocab < task.vocab_size:
        raise ValueError(
            f"model {model!r} has {vocab} vocabulary entries; task {task.name!r} uses {task.vocab_size}"
        )
    if lora is not None:
        targets = list(lora.targets) or None  # PEFT matches list entries as module-name suffixes
        net = with_lora(
            net, rank=lora.rank, alpha=lora.alpha, target_modules=targets, modules_to_save=None
        )
    return CausalLM(net)


def build_teacher(
    task: TaskSpec, source: str, *, vocab_size: int, model: str, shape: TinyShape, seed: int
) -> CausalLM:
    """A frozen teacher: `source` "init" is the run's seeded initial model (no LoRA), else a local checkpoint
    directory. Its vocabulary must be the student's (`vocab_size` LM head rows)."""
    if source == TEACHER_INIT:
        teacher = build_lm(task, model, shape, seed, None)
    elif Path(source).is_dir():
        teacher = CausalLM(load_pretrained(source))
    else:
        raise DistillationError(
            f"distill-teacher {source!r} is neither {TEACHER_INIT!r} nor a local checkpoint directory"
        )
    vocab = teacher.head_weight.shape[0]
    if vocab != vocab_size:
        raise DistillationError(
            f"teacher {source!r} has a vocabulary of {vocab} entries, the student {vocab_size}: distillation "
            "compares distributions over the same token ids, so use a teacher with the student's tokenizer"
        )
    teacher.requires_grad_(False)
    return teacher.eval()
