"""FedBuff: asynchronous buffered aggregation. The coordinator sends each site the newest model as soon as the
site has answered, and takes an outer step whenever K updates have arrived, whichever model version each started
from; stale updates weigh less (`staleness.StalenessBuffer`). The asynchronous round driver
(`hydrafl.server.aggregation.async_driver`) drives it; one of its "rounds" is one buffer. A model larger than the
coordinator keeps in memory has its buffer in a file too (`buffer_on_disk`, `add_on_disk` and `step_on_disk`).

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator
from hydrafl.strategies.buffer_on_disk import BufferOnDisk
from hydrafl.strategies.by_tensor import RoundFiles
from hydrafl.strategies.diloco import OuterConfig
from hydrafl.strategies.outer import OuterOptimizer
from hydrafl.strategies.registry import register
from hydrafl.strategies.staleness import BufferReport, BufferRule, StalenessBuffer, check_rule
from hydrafl.updates import records
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class FedBuff(FedAvg):
    """FedAvg's evaluation; training is one message per site at a time and a step per full buffer. With outer_lr
    1, no momentum and K fresh equal updates a step is FedAvg over those K sites."""

    consumes_deltas = True

    def __init__(self, config: BufferConfig | None = None, **kwargs: Any) -> None:
        """`config`: the buffer's and outer optimizer's knobs (default: FedBuff's); `kwargs`: FedAvg's."""
        super().__init__(**kwargs)
        config = config or FedBuffConfig()
        self.buffer = StalenessBuffer(rule=config.rule_of_buffer())
        self.outer = OuterOptimizer(
            lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_nesterov
        )
        self.accumulator = self.new_accumulator()
        self.disk_sums = self.new_disk_sums()
        """The buffer's sums when the model is kept on disk (`add_on_disk`)."""

    def new_accumulator(self) -> WeightedDeltaAccumulator:
        """The sums of one buffer (a subclass folds other updates: Hydra-nets' slices)."""
        return WeightedDeltaAccumulator(self.weighted_by_key)

    def new_disk_sums(self) -> BufferOnDisk:
        """`new_accumulator`'s sums in a file, for a model kept on disk (`by_tensor.buffers_by_its_rule`: a
        subclass that changes the one changes the other)."""
        return BufferOnDisk(self.weighted_by_key)

    def train_message(self, node: int, arrays: ArrayRecord, config: ConfigRecord) -> Message | None:
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(dict(config))})
        return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)

    def add(self, reply: Message, staleness: int) -> None:
        self.accumulator.add(reweighted(reply, self.weighted_by_key, self.buffer, staleness))

    @property
    def buffer_full(self) -> bool:
        return self.buffer.full

    def step(self, arrays: ArrayRecord) -> tuple[ArrayRecord, MetricRecord | None, BufferReport]:
        accumulator, self.accumulator = self.accumulator, self.new_accumulator()
        return self._flush(
            arrays,
            accumulator.metric_records,
            lambda scale: self.stepped(arrays, accumulator, scale),
        )

    def add_on_disk(
        self, reply: Message, staleness: int, arrays: ArrayRecord, files: RoundFiles
    ) -> None:
        """`add` of a model kept on disk (`by_tensor.BuffersByTensor`): into the buffer's file."""
        self.disk_sums.add(
            reweighted(reply, self.weighted_by_key, self.buffer, staleness), arrays, files
        )

    def step_on_disk(
        self, arrays: ArrayRecord, files: RoundFiles
    ) -> tuple[ArrayRecord, MetricRecord | None, BufferReport]:
        """`step` of a model kept on disk, tensor by tensor from the buffer's file, which goes after."""
        sums, self.disk_sums = self.disk_sums, self.new_disk_sums()
        try:
            return self._flush(
                arrays,
                sums.metric_records,
                lambda scale: sums.step(self.outer, arrays, scale, files),
            )
        finally:
            sums.discard()

    def _flush(
        self,
        arrays: ArrayRecord,
        metric_records: list[RecordDict],
        stepped: Callable[[float], ArrayRecord],
    ) -> tuple[ArrayRecord, MetricRecord | None, BufferReport]:
        """`stepped(scale)`, the model after the buffer's step (`arrays` when the ESS guard skips it), the
        buffer's metrics and report; the buffer's weights emptied."""
        report = self.buffer.flush()
        metrics = self.train_metrics_aggr_fn(metric_records, self.weighted_by_key)
        return (arrays if report.skipped else stepped(report.scale)), metrics, report

    def stepped(
        self, arrays: ArrayRecord, accumulator: WeightedDeltaAccumulator, scale: float
    ) -> ArrayRecord:
        """`arrays` after the outer step on the buffer's mean, times `scale`."""
        mean = accumulator.mean()
        updated = {
            name: self.outer.step(name, weights, mean[name].mul_(scale))
            if name in mean
            else weights
            for name, weights in from_record(arrays).items()
        }
        return to_record(updated)

    def state_dict(self) -> dict[str, Any]:
        return {**self.outer.state_dict(), **self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state)
        self.buffer.load_state_dict(state)
        self.accumulator = self.new_accumulator()
        self.disk_sums.discard()


def reweighted(
    reply: Message, weighted_by_key: str, buffer: StalenessBuffer, staleness: int
) -> Message:
    """`reply` with its weight replaced by its buffer weight (the accumulators read the weight from the reply);
    the driver hands each reply over once, so it is changed in place."""
    [metrics] = records(reply.content, MetricRecord)
    metrics[weighted_by_key] = buffer.weigh(
        reply.metadata.src_node_id, staleness, float(metrics[weighted_by_key])
    )
    return reply


@dataclass(frozen=True, kw_only=True)
class BufferConfig(OuterConfig):
    """The buffer's knobs, and the outer optimizer's with FedBuff's defaults (lr 1, no momentum)."""

    outer_lr: float = 1.0
    """Outer learning rate."""
    outer_momentum: float = 0.0
    """Outer momentum."""
    buffer_size: int = 2
    """K: the coordinator steps whenever this many updates have arrived."""
    staleness: str = "sqrt"
    """Staleness factor of an update tau model versions old: sqrt (1/sqrt(1+tau)) or poly ((1+tau)^-a)."""
    staleness_exponent: float = 0.5
    """a of the poly staleness factor."""
    weight_cap: float = 0.0
    """Truncate any one update's weight (staleness factor x its examples / the mean examples) at this; 0 = off."""
    ess_min: float = 0.0
    """Effective number of sites a buffer must average ((sum W)^2 / sum W^2 over per-site weights); 0 = off."""
    ess_action: str = "shrink"
    """A buffer below ess-min: skip it, or shrink its step by ESS / ess-min."""
    evaluate_every: int = 1
    """Evaluate every this many steps (and after the last); over a real grid an evaluation waits for each site to
    finish the training it is doing."""

    def __post_init__(self) -> None:
        OuterConfig.__post_init__(self)
        check_rule(self.rule_of_buffer())
        check(self.evaluate_every >= 1, "evaluate-every", self.evaluate_every, "an integer >= 1")

    def rule_of_buffer(self) -> BufferRule:
        return BufferRule(**{knob.name: getattr(self, knob.name) for knob in fields(BufferRule)})

    def check_run(self, run: RunConfig) -> None:
        """What the asynchronous driver does not do: per-round privacy, screening and diagnostics."""
        for key, on in (
            ("dp-clip", run.dp_clip),
            ("screen-norm", run.screen_norm),
            ("diagnostics", run.diagnostics),
            ("screen-cosine", run.screen_cosine > -1),
        ):
            check(
                not on,
                key,
                getattr(run, key.replace("-", "_")),
                f"off with strategy {run.strategy} (asynchronous rounds)",
            )
        check(
            run.fraction_train == 1,
            "fraction-train",
            run.fraction_train,
            "1 with FedBuff: every site trains all the time",
        )


@register("fedbuff")
@dataclass(frozen=True, kw_only=True)
class FedBuffConfig(BufferConfig):
    """FedBuff: an outer step whenever K updates arrived, staleness-weighted, without waiting for rounds."""

    def build(self, run: RunConfig, **common: Any) -> FedBuff:
        self.check_run(run)
        return FedBuff(self, **common)
