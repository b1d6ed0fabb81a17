"""Fixtures for the kernel tests: a probe for the largest tensor an operation creates."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """While active, records the element count of the largest tensor any op (forward or backward) returns.

    A kernel that claims O(window x chunk) or O(B x P) memory must never create a bigger intermediate.
    """

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


@pytest.fixture
def largest_tensor() -> LargestTensor:
    return LargestTensor()
