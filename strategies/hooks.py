"""The strategy contract: what a strategy must and may offer, on each side.

Required, to register (`registry.register`, which checks the declared capabilities against the config type,
`registry.check_capabilities`):
- a frozen `StrategyConfig` subclass holding the knobs (their defaults written there once, attribute
  docstrings as their help) and the capabilities as ClassVars (`federates_lora`, `lora_bases_travel`,
  `site_proximal_term`, `probes_curvature`, which needs an outer optimizer's knobs, `slices_transformer`,
  `secure_sum`, which decides secure aggregation's and central DP's eligibility: `registry.mean_strategies`);
- its `build(run, **common)`, making the coordinator half from the config object itself (`DiLoCo(self)`);
- the coordinator half: a Flower `Strategy` (`configure_train`, `aggregate_train`, `configure_evaluate`,
  `aggregate_evaluate`), usually a subclass of one of Flower's.

Optional, on the coordinator (the protocols below; the driver checks each with `isinstance`):
`ConsumesDeltas`, `ChecksReplyShapes`, `ExtraArrays`, `PlansSubnetworks`, `TakesSecureSums`, `QueriesSites`,
`BuffersUpdates`, and `state_dict`/`load_state_dict` for what a checkpoint must keep (`strategy_state`).

Optional, at the site: a site half (`site.SiteHalf`, registered under the same name with
`registry.register_site`, in a module the site imports alone): its hooks `subnet`, `lora_rank`,
`local_steps`, `loss` and `reply`, its `reply_arrays`, and its state in the site's `Context.state`.

Outside packages add both halves through the `hydrafl.strategies` entry-point group (`registry`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

if TYPE_CHECKING:
    from hydrafl.strategies.staleness import BufferReport
    from hydrafl.subnet.slices import Slice


@runtime_checkable
class ConsumesDeltas(Protocol):
    """Aggregates the sites' deltas (start - end) as they are; Flower's own strategies get weights instead."""

    consumes_deltas: bool


@runtime_checkable
class ChecksReplyShapes(Protocol):
    """Assigns each site part of every tensor, so the driver checks a reply against that part."""

    def reply_shapes(self, node: int, arrays: ArrayRecord) -> dict[str, tuple[int, ...]] | None:
        """The shape of each array `node`'s reply may carry; None when the node was assigned nothing."""


@runtime_checkable
class ExtraArrays(Protocol):
    """Its site half's replies carry ArrayRecords beside the delta (SCAFFOLD's control variate change); the
    reply checks admit exactly these, and its train messages name them (`hydrafl.updates.REPLY_ARRAYS`)."""

    reply_arrays: tuple[str, ...]


@runtime_checkable
class PlansSubnetworks(Protocol):
    """Gives each site its own share of the model; reports how many coordinates each one trained."""

    trainable_params: dict[int, dict[str, int]]
    """Per round, per site (node id as a string): the coordinates it was assigned to train."""


@runtime_checkable
class TakesSecureSums(Protocol):
    """Assigns each site slices of the model, and under secure aggregation takes the sites' per-coordinate sums
    instead of their replies: each site expands its slices to full shapes, with a 0/1 weight per coordinate."""

    count_once: bool
    """Every site weighs 1 on the coordinates it trained (else its weight)."""

    def site_slices(self, node: int) -> dict[str, Slice]:
        """The coordinates `node` trains this round."""

    def aggregate_summed(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the one reply holding ArrayRecords `sums` (sum of weight x delta, full shapes) and
        `weights` (the per-coordinate sum of weights) and the survivors' metrics."""


@runtime_checkable
class QueriesSites(Protocol):
    """Asks sites something before a training round (scores, tiers); the driver exchanges the queries like
    every other message (bytes counted, deadline, group id) and hands the replies back."""

    def configure_query(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The queries to send before round `server_round`'s training (none: nothing to ask)."""

    def aggregate_query(self, server_round: int, replies: Iterable[Message]) -> None:
        """Take in the replies to this round's queries."""


@runtime_checkable
class BuffersUpdates(Protocol):
    """Asynchronous: takes each site's update as it arrives and steps whenever its buffer is full
    (`hydrafl.server.aggregation.async_driver` drives it instead of rounds)."""

    buffer_full: bool

    def train_message(self, node: int, arrays: ArrayRecord, config: ConfigRecord) -> Message | None:
        """What `node` trains next, on `arrays` (None: it cannot train)."""

    def add(self, reply: Message, staleness: int) -> None:
        """Fold in one valid update that started `staleness` model versions ago."""

    def step(self, arrays: ArrayRecord) -> tuple[ArrayRecord, MetricRecord | None, BufferReport]:
        """The model after the full buffer's step (`arrays` itself when the buffer is skipped), and the
        buffer emptied."""


def strategy_state(strategy: Strategy) -> dict[str, Any]:
    """hydrafl strategies export `state_dict()`; Flower's keep state (FedOpt moments, FedAvgM momentum,
    current arrays) in plain attributes, which are saved whole except their callables (the aggregation
    functions and Bulyan's selection rule): those are code, which building the strategy gives the resume."""
    if hasattr(strategy, "state_dict"):
        return strategy.state_dict()
    return {key: value for key, value in vars(strategy).items() if not callable(value)}


def restore_strategy_state(strategy: Strategy, state: dict[str, Any]) -> None:
    if hasattr(strategy, "load_state_dict"):
        strategy.load_state_dict(state)
    else:
        vars(strategy).update(state)
