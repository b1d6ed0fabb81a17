"""A site's side of secure aggregation over the Message API: it answers the protocol's queries itself (the
ClientApp never sees them) and masks a train or evaluate reply after the site policy, so what leaves is one
masked vector: the policy's update (clipped to the run's honest-site bound, if any; with distributed DP clipped
and noised: `secagg.noise`), the site's weight and the metrics the round sums, and nothing in the clear. The round's
session lives in the site's persistent `context.state`, next to the site's identity, which whoever runs the site
puts there (`install_identity`: the site agent from its `--secagg-identity` file, a simulation from the keys it
issues): never anything the coordinator sent."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from hydrafl import protocol
from hydrafl.client.exchange_folder import ExchangeFolder
from hydrafl.client.masked_upload import encoded_windows, expanded_windows, masked_vector
from hydrafl.secagg import SecAggError, SiteIdentity, SiteSession, encode, encode_metrics, wire
from hydrafl.secagg.noise import DistributedNoise, Encoding
from hydrafl.secagg.quantize import METRIC_SLOTS
from hydrafl.subnet.slices import Slice
from hydrafl.tensor_files import as_record
from hydrafl.updates import records

STATE_KEY = "secagg"
"""The `context.state` ConfigRecord holding the current round's setup request and session."""
IDENTITY_KEY = "secagg.identity"
"""The `context.state` ConfigRecord holding the site's identity (`SiteIdentity.to_json`)."""


def install_identity(context: Context, identity: SiteIdentity) -> None:
    """Gives a site's Context the identity it signs its secure-aggregation keys with."""
    context.state[IDENTITY_KEY] = ConfigRecord({"identity": identity.to_json()})


def is_secagg_reply(message: Message) -> bool:
    """A train or evaluate message of a secure round: its reply leaves the site only masked."""
    return (
        message.metadata.message_type in ("train", "evaluate")
        and protocol.SECAGG_RECORD in message.content
    )


def answer_query(message: Message, context: Context) -> Message:
    """The reply to one of the protocol's queries (keys, shares, unmask); SecAggError on a bad request."""
    request = _secagg_record(message)
    kind = message.metadata.message_type
    if kind == protocol.QUERY_SECAGG_KEYS:
        server_round, participants, params, _ = wire.parse_keys_request(request)
        session = SiteSession.start(
            context.node_id, server_round, participants, params, _identity(context)
        )
        reply = wire.keys_reply(session.public_keys())
        context.state[STATE_KEY] = ConfigRecord(dict(request))
    elif kind == protocol.QUERY_SECAGG_SHARES:
        session = _load(context)
        node, keys = wire.parse_shares_request(request)
        if node != context.node_id:
            raise SecAggError(
                f"site {context.node_id}: a share-keys request addressed to site {node}"
            )
        reply = wire.sealed_record(session.share_keys(keys))
    elif kind == protocol.QUERY_SECAGG_CHECK:
        session = _load(context)
        reply = wire.check_reply(session.sign_survivors(wire.parse_check_request(request)))
    else:
        session = _load(context)
        reply = wire.unmask_reply(session.unmask(*wire.parse_unmask_request(request)))
    _save(context, session)
    return Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord(reply)}), reply_to=message)


def take_record(message: Message) -> ConfigRecord:
    """The shares (and slices) routed to the site, removed from the train message: the ClientApp never sees them."""
    record = _secagg_record(message)
    del message.content[protocol.SECAGG_RECORD]
    return record


def masked_reply(
    message: Message,
    reply: Message,
    context: Context,
    routed: ConfigRecord,
    *,
    honest: bool = True,
    exchange: ExchangeFolder | None = None,
) -> Message:
    """`reply` (the policy's) as the one masked vector that leaves the site: a train reply's delta (clipped to
    the run's honest-site bound, if any) and weight, then the metrics the round sums (`Layout.metrics`); an
    evaluate reply's weight and metrics only. Nothing else of the reply leaves: no metric, count, data hash
    or epsilon in the clear. `honest=False` plays a modified site that skips the bound (benchmarks, tests).
    A whole update's vector is made a window at a time (`masked_upload`), and goes into a file of `exchange`
    when larger than its memory bound."""
    if reply.has_error():
        return reply
    session = _load(context)
    _, participants, _, layout = wire.parse_keys_request(context.state[STATE_KEY])
    kind = message.metadata.message_type
    if kind != session.params.purpose:
        raise SecAggError(
            f"a {kind} message in a secure round set up to sum {session.params.purpose} replies"
        )
    distributed = bool(session.params.dp_clip)
    [metrics] = records(reply.content, MetricRecord)
    weight = metrics[layout.weight_key]
    params, rng = layout.scaled(session.params), np.random.default_rng()
    pieces: Iterable[np.ndarray]
    if kind == "evaluate":
        weight = _weight(weight, layout.count_once)
        pieces = [encode(np.zeros(0), weight, params, rng)]
        length = 1
    else:
        if distributed and not layout.count_once:
            raise SecAggError(
                "distributed DP needs every site to weigh 1, and this layout does not"
            )
        [delta] = [r for r in reply.content.values() if isinstance(r, ArrayRecord)]
        if layout.per_coordinate:
            shapes = dict(zip(layout.names, map(tuple, layout.shapes), strict=True))
        else:
            sent = next(iter(message.content.array_records.values()))
            shapes = {name: tuple(sent[name].shape) for name in layout.names if name in sent}
            if list(delta) != layout.names or any(
                tuple(delta[n].shape) != shapes.get(n) for n in layout.names
            ):
                raise SecAggError(
                    "the update's arrays differ from the model the round sent: it cannot be summed securely"
                )
        size = sum(math.prod(shape) for shape in shapes.values())
        # a window at a time: no float64 copy of the whole update; with distributed DP, the site's own clip
        # and noise share, so the coordinator sees a noised sum
        dp = DistributedNoise.of(params, size, len(participants)) if distributed else None
        encoding = Encoding(params, rng, session.params.site_clip if honest else None, dp)
        one = _weight(weight, layout.count_once)
        if (
            layout.per_coordinate
        ):  # its slices expanded to full shapes, with a weight per coordinate
            slices = {name: Slice(*spec) for name, spec in wire.parse_slices(routed).items()}
            pieces = expanded_windows(delta, slices, shapes, one, encoding)
            length = 2 * size
        else:
            pieces = encoded_windows(delta, layout.names, one, encoding)
            length = 1 + size
        weight = _weight(weight, layout.count_once or distributed)
    values = [_metric_value(metrics, name) for name, _ in layout.metrics]
    ranges = [r for _, r in layout.metrics]

    def with_slots() -> Iterator[np.ndarray]:
        """The pieces, then the metric slots: their draws after the update's, as in one encode."""
        yield from pieces
        yield encode_metrics(values, weight, ranges, params, rng)

    masks = session.masks(wire.parse_sealed(routed))
    length += METRIC_SLOTS * len(layout.metrics)
    masked = masked_vector(with_slots(), length, masks, exchange)
    _save(context, session)
    return Message(
        RecordDict({"arrays": as_record({protocol.SECAGG_MASKED: masked})}),
        reply_to=message,
    )


def _weight(weight: object, count_once: bool) -> int:
    """The integer weight a site encodes: 1 when every site counts once, else its reported example count."""
    if count_once:
        return 1
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight != int(weight):
        raise SecAggError(f"a site's weight must be a whole number of examples, got {weight!r}")
    return int(weight)


def _metric_value(metrics: MetricRecord, name: str) -> float | None:
    value = metrics.get(name) if name in metrics else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _secagg_record(message: Message) -> ConfigRecord:
    record = (
        message.content.get(protocol.SECAGG_RECORD)
        if protocol.SECAGG_RECORD in message.content
        else None
    )
    if not isinstance(record, ConfigRecord):
        raise SecAggError(
            f"a {message.metadata.message_type} message without its secure-aggregation record"
        )
    return record


def _save(context: Context, session: SiteSession) -> None:
    context.state[STATE_KEY]["session"] = session.to_state()


def _load(context: Context) -> SiteSession:
    if STATE_KEY not in context.state or "session" not in context.state[STATE_KEY]:
        raise SecAggError(
            f"site {context.node_id}: a secure-aggregation message before the round's setup"
        )
    return SiteSession.from_state(str(context.state[STATE_KEY]["session"]), _identity(context))


def _identity(context: Context) -> SiteIdentity:
    if IDENTITY_KEY not in context.state:
        raise SecAggError(
            f"site {context.node_id} has no secure-aggregation identity: start it with "
            "--secagg-identity FILE (`hydrafl admin site add --consortium-key` writes one)"
        )
    return SiteIdentity.from_json(str(context.state[IDENTITY_KEY]["identity"]))
