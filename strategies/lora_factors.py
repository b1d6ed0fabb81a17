"""LoRA factor pairs among the global arrays, and aggregation over their products B A instead of A and B apart.

Averaging A and B separately gives mean(B) mean(A), not mean(B A): the cross terms are noise (FedIT's flaw, which
FLoRA and FlexLoRA remove). Hydra over LoRA averages the products, masked to the heads each site ran, and
factors the result back to the run's rank (`MaskedProductAccumulator`, `svd_factors`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from hydrafl.arrays import from_record
from hydrafl.lora_pairs import LoraPair
from hydrafl.strategies.accumulator import AggregationError
from hydrafl.subnet.slices import Slice
from hydrafl.updates import records


def svd_factors(product: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B [out, rank], A [rank, in]) with B A the best rank-`rank` approximation of `product` (Eckart-Young),
    components ordered by singular value so that every prefix is the best approximation of its own rank.
    A = V^T keeps orthonormal rows even where a singular value is 0, so no component is dead (B can grow), as
    long as the rank is at most min(out, in)."""
    u, s, vh = torch.linalg.svd(product, full_matrices=False)
    b, a = torch.zeros(product.shape[0], rank), torch.zeros(rank, product.shape[1])
    k = min(rank, s.numel())
    b[:, :k], a[:k] = u[:, :k] * s[:k], vh[:k]
    return b, a


def reply_weight(reply: Message, key: str) -> float:
    """The reply's aggregation weight (e.g. num-examples); the accumulator it also went into checked it."""
    return float(records(reply.content, MetricRecord)[0][key])


def reply_delta(reply: Message, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The reply's delta arrays (start - end) as tensors; only those in `names` when given (no copy of the rest)."""
    record = records(reply.content, ArrayRecord)[0]
    if names is None:
        return from_record(record)
    return {name: torch.from_numpy(record[name].numpy()) for name in record if name in names}


def product_slice(a: Slice | None, b: Slice | None) -> Slice:
    """The part of B A a site trained, from its slices of A and B: the rows of its heads when B is cut by rows
    (q/k/v), their columns when A is cut by columns (the output projection), all of it when neither is cut."""
    a_cut = a is not None and a.dim is not None
    b_cut = b is not None and b.dim is not None
    if a_cut and b_cut:
        raise AggregationError(
            "a site trained a slice of both A and B of one module: its product is not one slice"
        )
    if b_cut and b.dim == 0:
        return Slice(0, b.index)
    if a_cut and a.dim == 1:
        return Slice(1, a.index)
    if a_cut or b_cut:
        raise AggregationError(
            "a LoRA factor is cut along its rank axis: Hydra keeps every rank component"
        )
    return Slice(None)


class MaskedProductAccumulator:
    """Per adapted module: sum_k w_k m_k B_k A_k and sum_k w_k m_k, where B_k A_k is the product site k ended
    with and m_k the rows (or columns) of its heads: a site's product says nothing about heads it did not run,
    even though its shared A (or B) moved them. One dense out x in sum per module, whatever the number of
    sites; the weights are whole rows (q/k/v) or columns (o), so their sum is a column or row vector (1 x 1
    while every site trained the whole module)."""

    def __init__(self, pairs: Iterable[LoraPair], start: Mapping[str, torch.Tensor]) -> None:
        self.pairs, self.start = list(pairs), start
        self.factors = {name for pair in self.pairs for name in (pair.a, pair.b)}
        """The arrays this accumulator owns; every other array is averaged coordinate by coordinate."""
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.start_products: dict[str, torch.Tensor] = {}
        """B0 A0 of each module `mean` averaged: the point its step starts from."""

    def add(self, reply: Message, slices: Mapping[str, Slice], weight: float) -> None:
        """Fold in one site's reply: its compact factor deltas (`Slice.take` shapes of `slices`, already checked
        by the coordinate accumulator the reply also went into)."""
        deltas = reply_delta(reply, self.factors)
        for pair in self.pairs:
            if pair.a not in deltas and pair.b not in deltas:
                continue  # the site did not train this module
            a, b = (self._end(name, deltas, slices) for name in (pair.a, pair.b))
            trained = product_slice(slices.get(pair.a), slices.get(pair.b))
            if pair.module not in self.sums:
                self.sums[pair.module] = torch.zeros(b.shape[0], a.shape[1])
                self.weights[pair.module] = torch.zeros(1, 1)
            if trained.dim == 0:  # only the trained rows of B_k A_k
                end = trained.take(b) @ a
            elif trained.dim == 1:  # only its trained columns
                end = b @ trained.take(a)
            else:
                end = b @ a
            trained.add_to(self.sums[pair.module], end, alpha=weight)
            self.weights[pair.module] = self.weights[pair.module] + _coverage(
                trained, self.sums[pair.module].shape, weight
            )

    def _end(
        self, name: str, deltas: Mapping[str, torch.Tensor], slices: Mapping[str, Slice]
    ) -> torch.Tensor:
        """The factor the site ended with: its start minus its delta on the slice it trained."""
        factor = self.start[name].float().clone()
        if name in deltas:
            slices[name].add_to(factor, deltas[name].float(), alpha=-1.0)
        return factor

    def mean(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per trained module: (masked weighted mean of B0 A0 - B_k A_k, 0 where no site trained; bool mask).
        Computed in place: the accumulator is spent afterwards."""
        out = {}
        for pair in self.pairs:
            if pair.module in self.sums:
                covered = (self.weights[pair.module] > 0).expand_as(self.sums[pair.module])
                mean_end = self.sums[pair.module].div_(self.weights[pair.module].clamp_(min=1e-30))
                self.start_products[pair.module] = start = (
                    self.start[pair.b].float() @ self.start[pair.a].float()
                )
                out[pair.module] = ((start - mean_end).mul_(covered), covered)
        return out


def _coverage(trained: Slice, shape: torch.Size, weight: float) -> torch.Tensor:
    """`weight` on the trained rows (as a column vector) or columns (as a row vector) of a module of `shape`,
    0 elsewhere; `weight` as a 1 x 1 when the whole module trained."""
    if trained.dim is None:
        return torch.full((1, 1), weight)
    size = [1, 1]
    size[trained.dim] = shape[trained.dim]
    coverage = torch.zeros(size)
    trained.add_to(coverage, torch.ones(trained.taken_shape(size)), alpha=weight)
    return coverage
