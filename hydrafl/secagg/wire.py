"""The protocol's messages as flat mappings of ints, bools, bytes and lists of them (what a Flower ConfigRecord
holds), and their parsers. Every parser checks types and lengths and raises SecAggError on anything else, so
both the site and the coordinator can refuse a malformed message before it reaches a state machine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hydrafl.secagg.params import SecAggError, SecAggParams
from hydrafl.secagg.site import SignedKeys

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Layout:
    """What a site encodes: the arrays in this order, each flattened; per coordinate (a subnetwork strategy's
    sites train slices) the full `shapes` with a 0/1 weight per coordinate, `count_once` weighing every site 1;
    then two slots per metric in `metrics` (`quantize.encode_metrics`), each clipped to [0, its range]."""

    weight_key: str
    names: list[str]
    per_coordinate: bool = False
    count_once: bool = False
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    metrics: list[tuple[str, float]] = field(default_factory=list)
    """(name, range) of each metric the sites sum securely, in this order."""

    def scaled(self, params: SecAggParams) -> SecAggParams:
        """The parameters both ends encode with: weighing every site 1, nothing need scale the update down."""
        return replace(params, max_weight=1) if self.count_once else params


def keys_request(
    server_round: int, participants: list[int], params: SecAggParams, layout: Layout
) -> Record:
    """Setup: who takes part, the parameters, and the layout of the vector each site will encode."""
    return {
        "round": server_round,
        "participants": list(participants),
        "weight-key": layout.weight_key,
        "names": list(layout.names),
        "per-coordinate": layout.per_coordinate,
        "count-once": layout.count_once,
        "ranks": [len(shape) for shape in layout.shapes],
        "sizes": [n for shape in layout.shapes for n in shape],
        "metric-names": [name for name, _ in layout.metrics],
        "metric-ranges": [float(r) for _, r in layout.metrics],
        **{f"param.{key}": value for key, value in params.to_config().items()},
    }


def parse_keys_request(record: Mapping[str, Any]) -> tuple[int, list[int], SecAggParams, Layout]:
    params = SecAggParams.from_config(
        {k[len("param.") :]: v for k, v in record.items() if k.startswith("param.")}
    )
    names, ranks, sizes = (
        _list(record, "names", str),
        _list(record, "ranks", int),
        _list(record, "sizes", int),
    )
    per_coordinate = _typed(record, "per-coordinate", bool)
    if (
        (per_coordinate and len(ranks) != len(names))
        or sum(ranks) != len(sizes)
        or min(sizes, default=1) < 1
    ):
        raise SecAggError("secure-aggregation layout: the shapes do not match the array names")
    shapes = [tuple(sizes[sum(ranks[:i]) : sum(ranks[: i + 1])]) for i in range(len(ranks))]
    metric_names, metric_ranges = (
        _list(record, "metric-names", str),
        _list(record, "metric-ranges", float),
    )
    _same_length(metric_names, metric_ranges)
    if any(not (0 < r < float("inf")) for r in metric_ranges) or len(set(metric_names)) != len(
        metric_names
    ):
        raise SecAggError(
            "secure-aggregation layout: metric ranges must be finite and > 0, metric names distinct"
        )
    layout = Layout(
        _typed(record, "weight-key", str),
        names,
        per_coordinate,
        _typed(record, "count-once", bool),
        shapes,
        list(zip(metric_names, metric_ranges, strict=True)),
    )
    return _int(record, "round"), _ints(record, "participants"), params, layout


def slices_record(slices: Mapping[str, tuple[int | None, tuple[int, ...]]]) -> Record:
    """Per array a site trains, (dim, index) of its slice (dim None: the whole array), for a train message."""
    names = list(slices)
    return {
        "slice.names": names,
        "slice.dims": [-1 if slices[n][0] is None else slices[n][0] for n in names],
        "slice.lengths": [len(slices[n][1]) for n in names],
        "slice.index": [i for n in names for i in slices[n][1]],
    }


def parse_slices(record: Mapping[str, Any]) -> dict[str, tuple[int | None, tuple[int, ...]]]:
    names, dims = _list(record, "slice.names", str), _list(record, "slice.dims", int)
    lengths, index = _list(record, "slice.lengths", int), _list(record, "slice.index", int)
    _same_length(names, dims, lengths)
    if sum(lengths) != len(index) or min(lengths, default=0) < 0:
        raise SecAggError("secure-aggregation slices: the index lengths do not add up")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return {
        name: (None if dim == -1 else dim, tuple(index[start : start + length]))
        for name, dim, start, length in zip(names, dims, starts, lengths, strict=True)
    }


_KEY_FIELDS = ("share-key", "mask-key", "commitment", "signing-key", "certificate", "signature")
"""`SignedKeys`' fields on the wire, in its order."""


def keys_reply(keys: SignedKeys) -> Record:
    return dict(zip(_KEY_FIELDS, keys.fields(), strict=True))


def parse_keys_reply(record: Mapping[str, Any]) -> SignedKeys:
    return SignedKeys(*(_typed(record, key, bytes) for key in _KEY_FIELDS))


def shares_request(node: int, keys: Mapping[int, SignedKeys]) -> Record:
    """Share keys, for site `node`: the signed key material of its neighbours (its own included)."""
    nodes = sorted(keys)
    return {
        "node": node,
        "nodes": nodes,
        **{key: [keys[n].fields()[i] for n in nodes] for i, key in enumerate(_KEY_FIELDS)},
    }


def parse_shares_request(record: Mapping[str, Any]) -> tuple[int, dict[int, SignedKeys]]:
    """(the site it was sent to, the signed key material by site)."""
    nodes, columns = _ints(record, "nodes"), [_list(record, key, bytes) for key in _KEY_FIELDS]
    _same_length(nodes, *columns)
    return _int(record, "node"), {
        node: SignedKeys(*fields) for node, *fields in zip(nodes, *columns, strict=True)
    }


def sealed_record(sealed: Mapping[int, bytes]) -> Record:
    """Encrypted shares by peer: a site's share-keys reply (peer = recipient) or what its train message
    carries (peer = sender)."""
    return _by_node(sealed, "nodes", "sealed")


def parse_sealed(record: Mapping[str, Any]) -> dict[int, bytes]:
    return _parse_by_node(record, "nodes", "sealed")


def check_request(survivors: list[int]) -> Record:
    """The consistency check: the survivor set each survivor is asked to sign."""
    return {"survivors": list(survivors)}


def parse_check_request(record: Mapping[str, Any]) -> list[int]:
    return _ints(record, "survivors")


def check_reply(signature: bytes) -> Record:
    return {"signature": signature}


def parse_check_reply(record: Mapping[str, Any]) -> bytes:
    return _typed(record, "signature", bytes)


def unmask_request(survivors: list[int], signatures: Mapping[int, bytes]) -> Record:
    """Unmask: the survivor set and the signatures over it that the coordinator collected."""
    return {"survivors": list(survivors), **_by_node(signatures, "signers", "signatures")}


def parse_unmask_request(record: Mapping[str, Any]) -> tuple[list[int], dict[int, bytes]]:
    return _ints(record, "survivors"), _parse_by_node(record, "signers", "signatures")


def unmask_reply(revealed: Mapping[int, bytes]) -> Record:
    return _by_node(revealed, "owners", "shares")


def parse_unmask_reply(record: Mapping[str, Any]) -> dict[int, bytes]:
    return _parse_by_node(record, "owners", "shares")


def _by_node(values: Mapping[int, bytes], nodes_key: str, values_key: str) -> Record:
    """Bytes per node as two parallel lists (a ConfigRecord holds lists, not mappings), in node order."""
    nodes = sorted(values)
    return {nodes_key: nodes, values_key: [values[n] for n in nodes]}


def _parse_by_node(record: Mapping[str, Any], nodes_key: str, values_key: str) -> dict[int, bytes]:
    nodes, values = _ints(record, nodes_key), _list(record, values_key, bytes)
    _same_length(nodes, values)
    return dict(zip(nodes, values, strict=True))


def _typed(record: Mapping[str, Any], key: str, kind: type) -> Any:
    value = record.get(key)
    if type(value) is not kind:
        raise SecAggError(
            f"secure-aggregation field {key!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _int(record: Mapping[str, Any], key: str) -> int:
    return _typed(record, key, int)


def _list(record: Mapping[str, Any], key: str, kind: type) -> list:
    values = _typed(record, key, list)
    if any(type(value) is not kind for value in values):
        raise SecAggError(f"secure-aggregation field {key!r} must be a list of {kind.__name__}")
    return values


def _ints(record: Mapping[str, Any], key: str) -> list[int]:
    values = _list(record, key, int)
    if len(set(values)) != len(values):
        raise SecAggError(f"secure-aggregation field {key!r} repeats a node")
    return values


def _same_length(*lists: list) -> None:
    if len({len(values) for values in lists}) != 1:
        raise SecAggError("secure-aggregation lists of differing lengths")
