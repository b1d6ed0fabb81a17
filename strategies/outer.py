"""The outer optimizer DiLoCo and Hydra share: SGD with (Nesterov) momentum over a pseudo-gradient, in
torch.optim.SGD's convention, per named tensor; a masked step leaves untouched coordinates and their momentum
as they were."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, Message

from hydrafl.strategies.by_tensor import MODEL, RoundFiles, delta_of, read_ahead, read_values
from hydrafl.strategies.parallel_fold import empty
from hydrafl.tensor_files import OnDiskArray, TensorFileWriter, as_record, layout_of

MOMENTUM = "momentum"


class OuterOptimizer:
    """lr 1 without momentum is the plain mean update (no outer optimizer). Its settings come from the
    strategy's config (`diloco.OuterConfig` and the like), where their defaults are written once."""

    def __init__(self, *, lr: float, momentum: float, nesterov: bool) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"the outer optimizer needs lr > 0 and 0 <= momentum < 1, got {lr=}, {momentum=}"
            )
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.momentum_buffer: dict[str, torch.Tensor | OnDiskArray] = {}

    def direction(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """b = mu b + d; the step goes along d + mu b (Nesterov) or b (heavy ball). A buffer kept on disk (a
        model larger than memory, `spill`) is read for the step."""
        if not self.momentum:
            return delta
        buffer = _resident(self.momentum_buffer.get(name))
        buffer = delta.clone() if buffer is None else buffer.mul_(self.momentum).add_(delta)
        self.momentum_buffer[name] = buffer
        return delta + self.momentum * buffer if self.nesterov else buffer

    def step(self, name: str, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return weights - self.lr * self.direction(name, delta)

    def step_(self, name: str, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`step` computed in place in `weights` and `delta`, which the caller owns (tensors read for this step,
        a model on disk): the same operations in the same order, so the same bits, without a new tensor per
        operation."""
        if self.momentum:
            kept = self.momentum_buffer.get(name)
            if kept is None:
                buffer = empty(tuple(delta.shape)).copy_(delta)
            else:
                resident = kept if isinstance(kept, torch.Tensor) else read_values(kept)
                buffer = torch.as_tensor(resident).mul_(self.momentum).add_(delta)
            self.momentum_buffer[name] = buffer
            scaled = torch.mul(
                buffer, self.lr if not self.nesterov else self.momentum, out=empty(buffer.shape)
            )
            if not self.nesterov:
                return weights.sub_(scaled)
            delta.add_(scaled)
        return weights.sub_(delta.mul_(self.lr))

    def masked_step(
        self, name: str, weights: torch.Tensor, delta: torch.Tensor, trained: torch.Tensor
    ) -> torch.Tensor:
        """The step where `trained`; elsewhere value and momentum stay as they were."""
        before = _resident(self.momentum_buffer.get(name))
        before = None if before is None else before.clone()
        direction = self.direction(name, delta)
        if before is not None:
            after = _resident(self.momentum_buffer[name])
            assert after is not None  # the step above kept a buffer
            self.momentum_buffer[name] = torch.where(trained, after, before)
        return torch.where(trained, weights - self.lr * direction, weights)

    def spill(
        self, shapes: Mapping[str, tuple[int, ...]], files: RoundFiles
    ) -> TensorFileWriter | None:
        """A file for this round's buffers (of the tensors `shapes` names, which take a step, and the older
        ones), to which `keep_on_disk` moves each buffer once its step is taken: None when the optimizer keeps
        no buffers. A buffer is float32, as the mean pseudo-gradient it starts from."""
        if not self.momentum:
            return None
        layout = {name: ("float32", tuple(shape)) for name, shape in shapes.items()}
        for name, buffer in self.momentum_buffer.items():
            layout[name] = (str(buffer.dtype).removeprefix("torch."), tuple(buffer.shape))
        return files.writer(MOMENTUM, layout) if layout else None

    def keep_on_disk(self, name: str, writer: TensorFileWriter) -> None:
        """Write `name`'s buffer to `writer` and keep only the file's copy."""
        if name in self.momentum_buffer:
            writer.write(name, self.momentum_buffer[name])
            self.momentum_buffer[name] = writer.mapped()[name]

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffer": {name: _copy(t) for name, t in self.momentum_buffer.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum_buffer = {name: _copy(t) for name, t in state["momentum_buffer"].items()}


def _resident(buffer: torch.Tensor | OnDiskArray | None) -> torch.Tensor | None:
    """A buffer in memory: one on disk is read (a fresh tensor, which the step may change in place)."""
    return torch.from_numpy(buffer.numpy()) if isinstance(buffer, OnDiskArray) else buffer


def _copy(buffer: torch.Tensor | OnDiskArray) -> torch.Tensor | OnDiskArray:
    """A tensor's own copy; a buffer on disk is never written in place (a new round writes a new file)."""
    return buffer.clone() if isinstance(buffer, torch.Tensor) else buffer


def step_by_tensor(
    outer: OuterOptimizer,
    start: ArrayRecord,
    replies: Sequence[Message],
    files: RoundFiles,
    step: Callable[[str, Array, list[Message]], torch.Tensor],
    order: Sequence[str] | None = None,
) -> ArrayRecord:
    """A round of a model on disk under `outer` (`by_tensor`): for each tensor read ahead (in `order`), its new
    values are `step(name, start values, replies cut to it)`, written to the round's model file, and its
    momentum buffer moves to the round's momentum file; tensors no reply updates are copied."""
    stepped = dict.fromkeys(name for reply in replies for name in delta_of(reply)[1])
    model = files.writer(MODEL, layout_of(start))
    momentum = outer.spill({name: start[name].shape for name in stepped}, files)
    for name, array, cut in read_ahead(start, replies, order):
        model.write(name, step(name, array, cut) if cut else array)
        if cut and momentum is not None:
            outer.keep_on_disk(name, momentum)
    if momentum is not None:
        for name in momentum.layout.keys() - stepped.keys():
            outer.keep_on_disk(name, momentum)
        momentum.close()
    return as_record(model.close())
