"""The subnetwork one site trains (`SubnetSpec`) and its codec into a flat Flower ConfigRecord.

The coordinator builds specs and the site applies them, so this module is pure data: it imports no torch, and
the architecture it checks a spec against is only a type here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hydrafl import protocol

if TYPE_CHECKING:
    from hydrafl.subnet.architecture import Architecture


class SpecError(ValueError):
    """A SubnetSpec that is malformed or does not fit the model; the message says what and where."""


def _int_tuple(values: Iterable[Any], what: str) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(f"{what} must be integers, got {v!r}")
        if v < 0:
            raise SpecError(f"{what} must be >= 0, got {v}")
        out.append(int(v))
    if len(set(out)) != len(out):
        raise SpecError(f"{what} contain duplicates: {out}")
    return tuple(out)


def _per_layer(
    selection: Iterable[Iterable[Any]] | None, layers: tuple[int, ...], unit: str
) -> tuple[tuple[int, ...], ...] | None:
    """A per-layer selection (heads or experts) checked against `layers` and sorted with them."""
    if selection is None:
        return None
    rows = tuple(selection)
    if len(rows) != len(layers):
        raise SpecError(
            f"{unit}s must give one tuple per selected layer: {len(layers)} layers, {len(rows)} {unit} tuples"
        )
    rows = tuple(
        _int_tuple(row, f"{unit} indices of layer {layer}")
        for layer, row in zip(layers, rows, strict=True)
    )
    for layer, row in zip(layers, rows, strict=True):
        if not row:
            raise SpecError(
                f"empty selection: layer {layer} keeps no {unit}s (drop the layer instead)"
            )
    order = sorted(range(len(layers)), key=lambda i: layers[i])
    return tuple(tuple(sorted(rows[i])) for i in order)


@dataclass(frozen=True)
class SubnetSpec:
    """The subnetwork one site trains.

    layers: selected layer indices (0-based; stored sorted).
    heads: per selected layer (aligned with `layers`), the kept head indices, i.e. KV-group indices under
        grouped-query attention (query heads follow their group); None keeps every head of every selected
        layer. Stored sorted.
    width_ratio: for the width-based baselines (HeteroFL, FjORD, FedRolex): in every selected layer, the share
        of each head's dims and of the FFN hidden units the site keeps (see `width_window`); 1 keeps all.
        A spec selects heads or a width, not both.
    width_offset: first kept channel of each width block (FedRolex's rolling window, wrapping around);
        0 keeps the leading channels (HeteroFL, FjORD).
    width_levels: FjORD's ordered dropout: before each forward pass the site draws a width uniformly from the
        levels below `width_ratio` and `width_ratio` itself; empty trains at `width_ratio` throughout.
    width_seed: seeds those draws. Part of the spec so that every process of a multi-process site draws the same
        widths; the strategy varies it per round and site.
    bypass: unselected layers are skipped (identity on hidden states, saves their compute) instead of frozen.
        This changes the function the site trains, so it is part of the spec, not a site-local choice.
    freeze_heads: dropped heads stay in the forward pass, frozen (their coordinates get zero gradient), instead
        of being masked out: the site trains the global model's own function, which matters for a pretrained
        model, and reads the dropped heads' coordinates too. Both cost the same compute.
    experts: of a mixture-of-experts model, per selected layer (aligned with `layers`), the experts the site
        trains, with the router rows that select them; the others stay in the forward pass, frozen, so the
        router sends tokens where the global model does. None trains every expert. Stored sorted.
    train_outside: the trainable tensors outside the transformer layers (classifier / LoRA-saved head,
        embeddings when trainable) are trained too; False freezes them.
    """

    layers: tuple[int, ...]
    heads: tuple[tuple[int, ...], ...] | None = None
    width_ratio: float = 1.0
    width_offset: int = 0
    width_levels: tuple[float, ...] = ()
    width_seed: int = 0
    bypass: bool = False
    train_outside: bool = True
    freeze_heads: bool = False
    experts: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        layers = _int_tuple(self.layers, "layer indices")
        if not layers:
            raise SpecError("empty selection: a SubnetSpec needs at least one layer")
        heads = _per_layer(self.heads, layers, "head")
        experts = _per_layer(self.experts, layers, "expert")
        ratio = self.width_ratio
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 0.0 < float(ratio) <= 1.0
        ):
            raise SpecError(f"width_ratio must be a number in (0, 1], got {ratio!r}")
        for key in ("width_offset", "width_seed"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{key} must be an integer >= 0, got {value!r}")
        levels = tuple(self.width_levels)
        if not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 < v <= 1.0
            for v in levels
        ):
            raise SpecError(f"width_levels must be numbers in (0, 1], got {list(levels)}")
        if (heads is not None or experts is not None) and (float(ratio) < 1.0 or levels):
            raise SpecError(
                "a SubnetSpec selects heads or a width (width_ratio < 1 / width_levels), not both "
                "(nor experts and a width)"
            )
        object.__setattr__(self, "layers", tuple(sorted(layers)))
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "experts", experts)
        object.__setattr__(self, "width_ratio", float(ratio))
        object.__setattr__(self, "width_levels", tuple(sorted({float(v) for v in levels})))
        object.__setattr__(self, "bypass", bool(self.bypass))
        object.__setattr__(self, "freeze_heads", bool(self.freeze_heads))
        object.__setattr__(self, "train_outside", bool(self.train_outside))

    @classmethod
    def full(cls, num_layers: int, **kwargs: Any) -> SubnetSpec:
        """Every layer, every head (the full model as a spec)."""
        return cls(layers=tuple(range(num_layers)), **kwargs)

    @property
    def is_width(self) -> bool:
        """A width-baseline spec (slices channels) rather than a Hydra layer/head selection."""
        return self.width_ratio < 1.0 or bool(self.width_levels)

    def heads_for(self, layer: int) -> tuple[int, ...] | None:
        """Kept heads (KV groups) of a selected layer; None means all. KeyError if the layer is not selected."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not selected (selected: {list(self.layers)})")
        return None if self.heads is None else self.heads[self.layers.index(layer)]

    def experts_for(self, layer: int) -> tuple[int, ...] | None:
        """Trained experts of a selected layer; None means all. KeyError if the layer is not selected."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not selected (selected: {list(self.layers)})")
        return None if self.experts is None else self.experts[self.layers.index(layer)]

    def check(self, arch: Architecture) -> None:
        """Raise SpecError if the spec does not fit the model."""
        if self.experts is not None:
            for layer, kept in zip(self.layers, self.experts, strict=True):
                if max(kept) >= arch.num_experts:
                    raise SpecError(
                        f"expert {max(kept)} of layer {layer} out of range: the model has "
                        f"{arch.num_experts} experts per layer"
                    )
        for layer in self.layers:
            if layer >= arch.num_layers:
                raise SpecError(
                    f"layer {layer} out of range: the model has {arch.num_layers} layers (0..{arch.num_layers - 1})"
                )
        if self.heads is not None:
            unit = "KV group" if arch.group_size > 1 else "head"
            for layer, kept in zip(self.layers, self.heads, strict=True):
                for h in kept:
                    if h >= arch.num_groups:
                        raise SpecError(
                            f"{unit} {h} of layer {layer} out of range: the model has {arch.num_groups} "
                            f"{unit}s per layer (0..{arch.num_groups - 1})"
                        )

    # ---- ConfigRecord (flat: str/int/float/bool and lists of one scalar type, no nested dicts) ----

    def to_config(
        self, prefix: str = protocol.SUBNET_PREFIX
    ) -> dict[str, int | float | bool | str | list[int]]:
        """Flat dict for a Flower ConfigRecord. Ragged per-layer heads are stored as counts + concatenation."""
        config: dict[str, Any] = {
            f"{prefix}layers": list(self.layers),
            f"{prefix}all-heads": self.heads is None,
            f"{prefix}width-ratio": self.width_ratio,
            f"{prefix}bypass": self.bypass,
            f"{prefix}train-outside": self.train_outside,
            f"{prefix}freeze-heads": self.freeze_heads,
        }
        if self.heads is not None:
            config[f"{prefix}head-counts"] = [len(h) for h in self.heads]
            config[f"{prefix}heads"] = [h for kept in self.heads for h in kept]
        if self.experts is not None:
            config[f"{prefix}expert-counts"] = [len(e) for e in self.experts]
            config[f"{prefix}experts"] = [e for kept in self.experts for e in kept]
        if self.width_offset:
            config[f"{prefix}width-offset"] = self.width_offset
        if self.width_levels:
            config[f"{prefix}width-levels"] = list(self.width_levels)
            config[f"{prefix}width-seed"] = self.width_seed
        return config

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], prefix: str = protocol.SUBNET_PREFIX
    ) -> SubnetSpec:
        """Inverse of `to_config`; raises SpecError naming the missing or malformed key."""

        def get(key: str, types: tuple[type, ...], default: Any = None) -> Any:
            name = prefix + key
            if name not in config and default is not None:
                return default
            if name not in config:
                raise SpecError(f"config has no {name!r} (keys: {sorted(config)})")
            value = config[name]
            if types == (list,):
                if not isinstance(value, (list, tuple)):
                    raise SpecError(f"{name!r} must be a list of integers, got {value!r}")
                return list(value)
            if isinstance(value, bool) and bool not in types:
                raise SpecError(
                    f"{name!r} must be {'/'.join(t.__name__ for t in types)}, got {value!r}"
                )
            if not isinstance(value, types):
                raise SpecError(
                    f"{name!r} must be {'/'.join(t.__name__ for t in types)}, got {value!r}"
                )
            return value

        def split(unit: str, plural: str) -> tuple[tuple[int, ...], ...]:
            """A ragged per-layer selection from its counts and its concatenation."""
            counts = get(f"{unit}-counts", (list,))
            flat = get(plural, (list,))
            if (
                len(counts) != len(layers)
                or sum(counts) != len(flat)
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)
            ):
                raise SpecError(
                    f"{prefix}{unit}-counts {counts} does not split {prefix}{plural} (length "
                    f"{len(flat)}) over {len(layers)} layers"
                )
            starts = [sum(counts[:i]) for i in range(len(counts))]
            return tuple(tuple(flat[s : s + c]) for s, c in zip(starts, counts, strict=True))

        layers = get("layers", (list,))
        heads = None if get("all-heads", (bool,)) else split("head", "heads")
        experts = split("expert", "experts") if prefix + "experts" in config else None
        return cls(
            layers=tuple(layers),
            heads=heads,
            width_ratio=get("width-ratio", (int, float)),
            width_offset=get("width-offset", (int,), 0),
            width_levels=tuple(get("width-levels", (list,), [])),
            width_seed=get("width-seed", (int,), 0),
            bypass=get("bypass", (bool,)),
            train_outside=get("train-outside", (bool,)),
            freeze_heads=get("freeze-heads", (bool,), False),
            experts=experts,
        )


__all__ = ["SpecError", "SubnetSpec"]
