"""Layer streaming (SlideDP): a site trains a model whose transformer blocks, with their gradients and optimizer
state, do not all fit in its compute device's memory.

The blocks' tensors live in a `layer_store.LayerStore` (host memory, or one safetensors file per block and kind
on disk, memory-mapped when read); everything outside the blocks (embeddings, head, final norm) stays on the
device and trains as usual. A sliding window of blocks passes through the device:

- forward: each block's call goes through `_StreamedBlock`, which materialises the block's weights, runs it
  without building a graph, keeps only its inputs (activation checkpointing at block boundaries) and releases
  the weights; while block i computes, a background thread (a CUDA copy stream on a GPU) reads the next
  `window - 1` blocks;
- backward (blocks in reverse): the block is materialised again, its forward re-run with a graph and
  backpropagated; the block's gradients are written back to the store, and the gradient of its inputs flows on;
- step: the global gradient peak is known once every block's gradient is written (the inner optimizer's
  zero-gradient rule, `kernels.optimizers.skip_zero_gradients`, compares against it), so the update is its own
  pass over the blocks: weights, gradients and optimizer state in, updated weights and state back out.

Each parameter gets the same gradient and the same optimizer arithmetic as in-memory training, so SGD gives the
in-memory delta bit for bit (CPU), and AdamW within float tolerance. At most `window` blocks' tensors are
materialised at any time (`LayerStream.peak_resident_bytes` counts them); on CPU with the disk store this bounds
resident memory too, since a block's weights exist in memory only inside the window. Layers a Hydra spec bypasses
are offloaded and never read; frozen ones (unselected layers, LoRA bases) stream read-only.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hydrafl.kernels.layer_store import LayerStore, Tensors, open_store
from hydrafl.kernels.optimizers import InnerOptimizer, inner_optimizer, zero_gradient
from hydrafl.subnet.architecture import find_architecture

if TYPE_CHECKING:
    from hydrafl.kernels.local_training import LocalTraining

__all__ = ["LayerStream", "streamed"]


class _Loaded:
    """A block's tensors materialised on the compute device, and what they cost."""

    def __init__(self, tensors: Tensors, ready: torch.cuda.Event | None) -> None:
        self.tensors, self.ready = tensors, ready
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())


class _Window:
    """Reads ahead along `order`: when block `order[k]` is taken, blocks `order[k+1 .. k+size-1]` are being read,
    so at most `size` blocks are materialised (the one in use and those read ahead)."""

    def __init__(
        self, order: list[int], size: int, load: Callable[[int], _Loaded], stream: LayerStream
    ) -> None:
        self.order, self.size, self.load, self.stream = order, size, load, stream
        self.pending: deque[tuple[int, Future[_Loaded]]] = deque()
        self.next = 0
        """Position in `order` of the next block to read ahead."""

    def take(self, layer: int) -> _Loaded:
        # a block called out of order: drop what was read ahead of it
        while self.pending and self.pending[0][0] != layer:
            self.stream._forget(self.pending.popleft()[1].result())
        if self.pending:
            future = self.pending.popleft()[1]
        else:
            future = self.stream._executor.submit(self.load, layer)
            self.next = self.order.index(layer) + 1
        while len(self.pending) < self.size - 1 and self.next < len(self.order):
            ahead = self.order[self.next]
            self.pending.append((ahead, self.stream._executor.submit(self.load, ahead)))
            self.next += 1
        loaded = future.result()
        if loaded.ready is not None:
            torch.cuda.current_stream().wait_event(loaded.ready)
            for tensor in loaded.tensors.values():
                if tensor.is_cuda:
                    tensor.record_stream(torch.cuda.current_stream())
        return loaded

    def clear(self) -> None:
        while self.pending:
            self.stream._forget(self.pending.popleft()[1].result())


class LayerStream:
    """Stream `model`'s transformer blocks through `device` while it trains (a context manager).

    On entry the blocks' weights move into `store` and out of the model (each parameter keeps its identity, so
    hooks, masks and `requires_grad` stay as they are); on exit they come back, trained, onto the device they
    started on. In between, `loss.backward()` writes every block's gradients to the store, and `step(resident)`
    updates the model: `resident`, the inner optimizer over the parameters outside the blocks, and the blocks,
    one window at a time.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        window: int,
        store: LayerStore,
        device: torch.device,
        optimizer: Callable[[list[tuple[str, nn.Parameter]]], InnerOptimizer],
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        arch = find_architecture(model)
        self.model, self.store, self.device, self.window = model, store, device, window
        self.optimizer = optimizer
        """Builds the inner optimizer over named parameters (`kernels.optimizers.inner_optimizer`)."""
        self.names = [ref.name for ref in arch.layers]
        self.blocks: list[nn.Module] = [model.get_submodule(name) for name in self.names]
        self.active = [i for i, b in enumerate(self.blocks) if "forward" not in b.__dict__]
        """Blocks that compute (a Hydra spec's bypass replaces a block's forward by the identity)."""
        self.peak_resident_bytes = 0
        """The most bytes of block tensors (weights, gradients, optimizer state) materialised at once."""
        self._resident = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-stream")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._home: list[torch.device] = []
        self._peaks: dict[int, dict[str, float]] = {}
        self._anchor = torch.empty(0, requires_grad=True)
        self._passes = {
            "forward": _Window(self.active, window, self._load_weights, self),
            "backward": _Window(self.active[::-1], window, self._load_weights, self),
        }

    def parameters(self) -> set[nn.Parameter]:
        """The parameters that stream (every block's); the resident optimizer takes the others."""
        return {p for block in self.blocks for p in block.parameters()}

    def __enter__(self) -> LayerStream:
        self._home = [next(b.parameters()).device for b in self.blocks]
        for i, block in enumerate(self.blocks):
            named = dict(block.named_parameters())
            self.store.put(
                i, "frozen", {n: p.data for n, p in named.items() if not p.requires_grad}
            )
            self.store.put(i, "trainable", {n: p.data for n, p in named.items() if p.requires_grad})
            self._release(block)
            if i in self.active:
                block.forward = _StreamedForward(self, i, block.forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for window in self._passes.values():
            window.clear()
        self._executor.shutdown()
        for i, block in enumerate(self.blocks):
            if isinstance(block.__dict__.get("forward"), _StreamedForward):
                del block.forward
            tensors = {**self.store.get(i, "frozen"), **self.store.get(i, "trainable")}
            for name, p in block.named_parameters():
                p.data = tensors[name].to(self._home[i])

    def step(self, resident: InnerOptimizer) -> None:
        """One optimizer step of the whole model, after `loss.backward()`."""
        resident_params = [
            p for o in resident.optimizers for g in o.param_groups for p in g["params"]
        ]
        peaks = [
            float(p.grad.detach().abs().amax().float())
            for p in resident_params
            if p.grad is not None
        ]
        largest = max(
            [*peaks, *(v for layer in self._peaks.values() for v in layer.values())], default=0.0
        )
        resident.step(largest=largest)
        order = sorted(self._peaks)
        window = _Window(order, self.window, self._load_update, self)
        for layer in order:
            loaded = window.take(layer)
            self._update(layer, loaded, largest)
            self._forget(loaded)
        self._peaks = {}

    def _update(self, layer: int, loaded: _Loaded, largest: float) -> None:
        """One block's optimizer step, with the optimizer state read from (and written back to) the store."""
        named = [(n, p) for n, p in self.blocks[layer].named_parameters() if p.requires_grad]
        for name, p in named:
            p.data = loaded.tensors[f"trainable/{name}"]
            grad = loaded.tensors.get(f"grads/{name}")
            keep = grad is not None and not zero_gradient(self._peaks[layer][name], grad, largest)
            p.grad = grad if keep else None
        # full names: Muon tells its matrices by name
        optimizer = self.optimizer([(f"{self.names[layer]}.{n}", p) for n, p in named])
        name_of = {id(p): name for name, p in named}
        states: Tensors = {}
        for torch_optimizer in optimizer.optimizers:
            params = [p for group in torch_optimizer.param_groups for p in group["params"]]
            for p in params:
                prefix = f"state/{name_of[id(p)]}/"
                state = {
                    k[len(prefix) :]: t for k, t in loaded.tensors.items() if k.startswith(prefix)
                }
                if state:
                    torch_optimizer.state[p] = state
            torch_optimizer.step()
            for p in params:
                for key, t in torch_optimizer.state.get(p, {}).items():
                    states[f"{name_of[id(p)]}/{key}"] = t
        self.store.put(layer, "trainable", {name: p.data for name, p in named})
        self.store.put(layer, "state", states)
        self.store.drop(layer, "grads")
        self._release(self.blocks[layer])

    def _run(self, layer: int, forward: Callable[..., Any], flat: list[Any], spec: Any) -> Any:
        """The block's forward on its materialised weights (forward pass: no graph)."""
        loaded = self._passes["forward"].take(layer)
        try:
            self._materialise(layer, loaded)
            args, kwargs = pytree.tree_unflatten(flat, spec)
            with torch.no_grad():
                return forward(*args, **kwargs)
        finally:
            self._release(self.blocks[layer])
            self._forget(loaded)

    def _rerun_backward(
        self,
        layer: int,
        forward: Callable[..., Any],
        flat: list[Any],
        spec: Any,
        inputs: list[torch.Tensor],
        grads: tuple[torch.Tensor | None, ...],
    ) -> None:
        """Re-run the block with a graph and backpropagate `grads` into its inputs and weights; write its
        weights' gradients back to the store."""
        loaded = self._passes["backward"].take(layer)
        try:
            self._materialise(layer, loaded)
            params = [p for p in self.blocks[layer].parameters() if p.requires_grad]
            args, kwargs = pytree.tree_unflatten(flat, spec)
            with torch.enable_grad():
                outputs = pytree.tree_leaves(forward(*args, **kwargs))
            pairs = [
                (o, g)
                for o, g in zip(outputs, grads, strict=True)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            if pairs and (inputs or params):
                torch.autograd.backward(
                    [o for o, _ in pairs], [g for _, g in pairs], inputs=[*inputs, *params]
                )
            named = {
                n: p.grad for n, p in self.blocks[layer].named_parameters() if p.grad is not None
            }
            if named:
                self._count(sum(g.numel() * g.element_size() for g in named.values()))
                self._peaks[layer] = {
                    n: float(g.detach().abs().amax().float()) for n, g in named.items()
                }
                self.store.put(layer, "grads", named)
                self._count(-sum(g.numel() * g.element_size() for g in named.values()))
        finally:
            self._release(self.blocks[layer])
            self._forget(loaded)

    def _load_weights(self, layer: int) -> _Loaded:
        return self._load({**self.store.get(layer, "frozen"), **self.store.get(layer, "trainable")})

    def _load_update(self, layer: int) -> _Loaded:
        return self._load(
            {
                f"{kind}/{name}": t
                for kind in ("trainable", "grads", "state")
                for name, t in self.store.get(layer, kind).items()
            }
        )

    def _load(self, host: Tensors) -> _Loaded:
        """Runs on the read-ahead thread: copy a block's tensors to the device (on the copy stream). A 0-d tensor
        (Adam's step count) stays on the CPU, where the in-memory optimizer keeps it."""
        if self._copy_stream is None:
            loaded = _Loaded({n: _to(t, self.device) for n, t in host.items()}, None)
        else:
            with torch.cuda.stream(self._copy_stream):
                tensors = {n: _to(t, self.device, non_blocking=True) for n, t in host.items()}
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
            loaded = _Loaded(tensors, ready)
        self._count(loaded.nbytes)
        return loaded

    def _forget(self, loaded: _Loaded) -> None:
        self._count(-loaded.nbytes)
        loaded.tensors = {}

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._resident += nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident)

    def _materialise(self, layer: int, loaded: _Loaded) -> None:
        for name, p in self.blocks[layer].named_parameters():
            p.data = loaded.tensors[name]

    def _release(self, block: nn.Module) -> None:
        for p in block.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None


class _StreamedForward:
    """A streamed block's `forward`: its call goes through `_StreamedBlock` (module hooks stay outside)."""

    def __init__(self, stream: LayerStream, layer: int, forward: Callable[..., Any]) -> None:
        self.stream, self.layer, self.forward = stream, layer, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        trains = any(p.requires_grad for p in self.stream.blocks[self.layer].parameters())
        call = _BlockCall(self, spec)
        # the anchor makes autograd call backward for a block that trains even when its input needs no
        # gradient (LoRA, frozen embeddings)
        anchor = self.stream._anchor if trains else torch.empty(0)
        outputs = _StreamedBlock.apply(call, anchor, *flat)
        return pytree.tree_unflatten(list(outputs), call.out_spec)


@dataclass(slots=True)
class _BlockCall:
    """One call of a streamed block: how to rebuild its arguments and its output."""

    forward: _StreamedForward
    spec: Any
    out_spec: Any = None


class _StreamedBlock(torch.autograd.Function):
    """Checkpoint at the block boundary: forward keeps only the block's inputs; backward re-runs the block
    (same RNG and autocast state) inside the window and backpropagates through it."""

    @staticmethod
    def forward(ctx: Any, call: _BlockCall, anchor: torch.Tensor, *flat: Any) -> Any:
        device = call.forward.stream.device
        ctx.call, ctx.rng = call, _rng_state(device)
        ctx.autocast = (
            torch.get_autocast_dtype(device.type)
            if torch.is_autocast_enabled(device.type)
            else None
        )
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in flat]
        ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in flat))
        out = call.forward.stream._run(
            call.forward.layer, call.forward.forward, list(flat), call.spec
        )
        leaves, call.out_spec = pytree.tree_flatten(out)
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _BlockCall = ctx.call
        stream = call.forward.stream
        flat: list[Any] = []
        inputs: list[torch.Tensor] = []
        for i, (saved, other) in enumerate(zip(ctx.saved_tensors, ctx.others, strict=True)):
            if saved is None:
                flat.append(other)
                continue
            needs = ctx.needs_input_grad[i + 2]
            tensor = saved.detach().requires_grad_(needs)
            flat.append(tensor)
            if needs:
                inputs.append(tensor)
        with (
            torch.random.fork_rng(devices=_rng_devices(stream.device)),
            _autocast(stream.device, ctx.autocast),
        ):
            _set_rng_state(stream.device, ctx.rng)
            stream._rerun_backward(
                call.forward.layer, call.forward.forward, flat, call.spec, inputs, grads
            )
        input_grads = iter(t.grad for t in inputs)
        return (
            None,
            None,
            *(next(input_grads) if ctx.needs_input_grad[i + 2] else None for i in range(len(flat))),
        )


def _to(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    return tensor if tensor.dim() == 0 else tensor.to(device, non_blocking=non_blocking)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@contextmanager
def streamed(
    model: nn.Module, training: LocalTraining, device: torch.device
) -> Iterator[LayerStream]:
    """`model`'s blocks streamed through `device` as `training` says (its window, store and inner optimizer)."""
    optimizer = partial(
        inner_optimizer, name=training.optimizer, lr=training.lr, weight_decay=training.weight_decay
    )
    with (
        open_store(training.stream_offload, device) as store,
        LayerStream(
            model, window=training.window, store=store, device=device, optimizer=optimizer
        ) as stream,
    ):
        yield stream
