"""FedBuff over Hydra-nets: the buffered, staleness-weighted step of `fedbuff` on the masked per-coordinate mean
of Hydra. The planning round runs once, before the first message; each site keeps its Hydra-net (the top layers
of the global ranking and its own top heads) for the whole run, downloads what its net reads and uploads its
slices. A buffer's step is the masked weighted mean of its updates, times the buffer's scale (sum w / K and the
ESS guard's shrink), through the outer optimizer on the trained coordinates. Over LoRA, A and B are averaged
coordinate by coordinate (Hydra's `hydra-lora=factors`). A model kept on disk keeps the buffer's sums and
per-coordinate weights in a file (`buffer_on_disk.MaskedBufferOnDisk`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from hydrafl import protocol
from hydrafl.arrays import from_record, sliced_record, to_record
from hydrafl.strategies.accumulator import MaskedDeltaAccumulator
from hydrafl.strategies.budgets import BudgetConfig
from hydrafl.strategies.buffer_on_disk import MaskedBufferOnDisk
from hydrafl.strategies.fedbuff import BufferConfig, FedBuff, reweighted
from hydrafl.strategies.hydra import HEAD_MODES
from hydrafl.strategies.planner import BudgetError, SitePlanner
from hydrafl.strategies.registry import register
from hydrafl.subnet.slices import Slice, layout_slices, read_slices
from hydrafl.subnet.spec import SubnetSpec
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig

log = logging.getLogger(__name__)


class FedBuffHydra(FedBuff):
    """FedBuff with per-site Hydra-nets from one planning round; a masked step per full buffer."""

    def __init__(
        self,
        config: BufferConfig | None = None,
        *,
        planner: SitePlanner | None = None,
        bypass: bool = False,
        freeze_heads: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self.planner = planner or SitePlanner()
        self.planner.scoring[protocol.SCORE_BYPASS] = bypass
        self.bypass, self.freeze_heads = bypass, freeze_heads
        self.specs: dict[int, SubnetSpec] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        """The global tensors' shapes, which the sites' slices fold back into."""

    def new_accumulator(self) -> MaskedDeltaAccumulator:
        return MaskedDeltaAccumulator(self.weighted_by_key)

    def new_disk_sums(self) -> MaskedBufferOnDisk:
        return MaskedBufferOnDisk(self.weighted_by_key, self.site_slices)

    def configure_query(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return (
            self.planner.queries(arrays, config, grid.get_node_ids())
            if not self.planner.ranking
            else []
        )

    def aggregate_query(self, server_round: int, replies: Iterable[Message]) -> None:
        self.planner.take_replies(replies, self.weighted_by_key)

    def train_message(self, node: int, arrays: ArrayRecord, config: ConfigRecord) -> Message | None:
        """The site's Hydra-net of the newest model; None when it missed the planning round or nothing fits it."""
        if node not in self.planner.site_scores:
            log.warning("fedbuff-hydra: site %d missed the planning round; not training it", node)
            return None
        if node not in self.specs:
            try:
                self.specs[node] = self.planner.hydra_spec(
                    node, bypass=self.bypass, freeze_heads=self.freeze_heads
                )
            except BudgetError as error:
                log.warning("fedbuff-hydra: site %d cannot train: %s", node, error)
                return None
        self.shapes = {name: tuple(array.shape) for name, array in arrays.items()}
        layers = {name: layer for name, (layer, _, _) in self.planner.layout.items()}
        download = sliced_record(
            arrays, read_slices(self.site_slices(node), layers, self.specs[node])
        )
        content = RecordDict(
            {"arrays": download, "config": ConfigRecord({**config, **self.specs[node].to_config()})}
        )
        return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)

    def site_slices(self, node: int) -> dict[str, Slice]:
        return layout_slices(self.planner.layout, self.specs[node])

    def reply_shapes(self, node: int, arrays: ArrayRecord) -> dict[str, tuple[int, ...]] | None:
        if node not in self.specs:
            return None
        return {
            name: sl.taken_shape(arrays[name].shape) for name, sl in self.site_slices(node).items()
        }

    def add(self, reply: Message, staleness: int) -> None:
        slices = self.site_slices(reply.metadata.src_node_id)
        self.accumulator.add_slices(
            reweighted(reply, self.weighted_by_key, self.buffer, staleness), slices, self.shapes
        )

    def stepped(
        self, arrays: ArrayRecord, accumulator: MaskedDeltaAccumulator, scale: float
    ) -> ArrayRecord:
        """The outer step on each trained coordinate's masked mean, times `scale`."""
        weights = from_record(arrays)
        for name, (delta, trained) in accumulator.mean().items():
            weights[name] = self.outer.masked_step(name, weights[name], delta.mul_(scale), trained)
        return to_record(weights)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            **self.planner.state_dict(),
            "specs": dict(self.specs),
            "shapes": dict(self.shapes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.planner.load_state_dict(state)
        self.specs, self.shapes = dict(state["specs"]), dict(state["shapes"])


@register("fedbuff-hydra")
@dataclass(frozen=True, kw_only=True)
class FedBuffHydraConfig(BudgetConfig, BufferConfig):
    """FedBuff over Hydra-nets: buffered staleness-weighted steps on the masked mean of per-site subnetworks."""

    hydra_bypass: bool = False
    """A site skips the layers outside its Hydra-net (identity) instead of running them frozen."""
    hydra_head_mode: str = "freeze"
    """The heads outside a site's net are frozen (they run, untrained) or dropped (masked out)."""

    def __post_init__(self) -> None:
        BudgetConfig.__post_init__(self)
        BufferConfig.__post_init__(self)
        check(
            self.hydra_head_mode in HEAD_MODES,
            "hydra-head-mode",
            self.hydra_head_mode,
            ", ".join(HEAD_MODES),
        )
        check(
            not self.rule().robust,
            "robust-rule",
            self.robust_rule,
            "mean with fedbuff-hydra (a buffer streams)",
        )

    def build(self, run: RunConfig, **common: Any) -> FedBuffHydra:
        self.check_run(run)
        return FedBuffHydra(
            self,
            planner=self.planner(run),
            bypass=self.hydra_bypass,
            freeze_heads=self.hydra_head_mode == "freeze",
            **common,
        )
