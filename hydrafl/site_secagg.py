"""A site's side of secure aggregation over the Message API: it answers the protocol's queries itself (the
ClientApp never sees them) and masks a train reply after the site policy, so what leaves is the policy's
update, encoded and masked (with distributed DP, clipped and noised first: `secagg.noise`). The round's
session lives in the site's persistent `context.state`, next to the site's identity, which whoever runs the site
puts there (`install_identity`: the site agent from its `--secagg-identity` file, a simulation from the keys it
issues): never anything the coordinator sent."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from hydrafl import protocol
from hydrafl.secagg import SecAggError, SiteIdentity, SiteSession, encode, wire
from hydrafl.secagg.noise import DistributedNoise
from hydrafl.updates import records

STATE_KEY = "secagg"
"""The `context.state` ConfigRecord holding the current round's setup request and session."""
IDENTITY_KEY = "secagg.identity"
"""The `context.state` ConfigRecord holding the site's identity (`SiteIdentity.to_json`)."""


def install_identity(context: Context, identity: SiteIdentity) -> None:
    """Gives a site's Context the identity it signs its secure-aggregation keys with."""
    context.state[IDENTITY_KEY] = ConfigRecord({"identity": identity.to_json()})


def is_secagg_train(message: Message) -> bool:
    return message.metadata.message_type == "train" and protocol.SECAGG_RECORD in message.content


def answer_query(message: Message, context: Context) -> Message:
    """The reply to one of the protocol's queries (keys, shares, unmask); SecAggError on a bad request."""
    request = _secagg_record(message)
    kind = message.metadata.message_type
    if kind == protocol.QUERY_SECAGG_KEYS:
        server_round, participants, params, _ = wire.parse_keys_request(request)
        session = SiteSession.start(context.node_id, server_round, participants, params, _identity(context))
        reply = wire.keys_reply(session.public_keys())
        context.state[STATE_KEY] = ConfigRecord(dict(request))
    elif kind == protocol.QUERY_SECAGG_SHARES:
        session = _load(context)
        node, keys = wire.parse_shares_request(request)
        if node != context.node_id:
            raise SecAggError(f"site {context.node_id}: a share-keys request addressed to site {node}")
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


def masked_reply(message: Message, reply: Message, context: Context, routed: ConfigRecord) -> Message:
    """`reply` (the policy's) with its delta and weight encoded and masked; its other metrics stay."""
    if reply.has_error():
        return reply
    session = _load(context)
    _, participants, _, layout = wire.parse_keys_request(context.state[STATE_KEY])
    distributed = bool(session.params.dp_clip)
    if distributed and (layout.per_coordinate or not layout.count_once):
        raise SecAggError("distributed DP needs every site to weigh 1 on the whole model, and this layout does not")
    [(array_key, delta)] = [(k, r) for k, r in reply.content.items() if isinstance(r, ArrayRecord)]
    [metrics] = records(reply.content, MetricRecord)
    weight = metrics[layout.weight_key]
    if layout.per_coordinate:
        flat, weights = _expanded(delta, wire.parse_slices(routed), layout, 1 if layout.count_once else weight)
    else:
        sent = next(iter(message.content.array_records.values()))
        if list(delta) != layout.names or any(tuple(delta[n].shape) != tuple(sent[n].shape) for n in layout.names):
            raise SecAggError("the update's arrays differ from the model the round sent: it cannot be summed securely")
        flat, weights = np.concatenate([delta[name].numpy().astype(np.float64).ravel() for name in layout.names]), weight
    params, rng = layout.scaled(session.params), np.random.default_rng()
    if distributed:  # the site's own clip and noise share: the coordinator only ever sees a noised sum
        encoded = DistributedNoise.of(params, flat.size, len(participants)).encode(flat, params, rng)
    else:
        encoded = encode(flat, weights, params, rng)
    masked = session.mask(encoded, wire.parse_sealed(routed))
    _save(context, session)
    content = RecordDict()
    for key, record in reply.content.items():
        if key == array_key:
            content[key] = ArrayRecord({protocol.SECAGG_MASKED: Array(masked)})
        elif isinstance(record, MetricRecord):
            content[key] = MetricRecord({k: v for k, v in record.items() if k != layout.weight_key})
        else:
            content[key] = record
    return Message(content, reply_to=message)


def _expanded(delta: ArrayRecord, slices: dict, layout: wire.Layout, weight: int) -> tuple[np.ndarray, np.ndarray]:
    """A subnetwork's compact slices as full-shape vectors: the delta (0 off the slices) and a per-coordinate
    weight (`weight` on the slices, 0 off them). Imports torch here, for subnetworks only: the in-process grid
    answers through this module, and a stock Flower app's simulation need not load torch."""
    import torch

    from hydrafl.subnet.slices import Slice

    if set(delta) != set(slices) or not set(slices) <= set(layout.names):
        raise SecAggError("the update's arrays differ from the slices the round assigned: it cannot be summed securely")
    values, weights = [], []
    for name, shape in zip(layout.names, layout.shapes):
        if name not in slices:
            values.append(np.zeros(int(np.prod(shape))))
            weights.append(np.zeros(int(np.prod(shape)), dtype=np.int64))
            continue
        sl = Slice(*slices[name])
        try:
            full = sl.put(torch.zeros(shape, dtype=torch.float64), torch.from_numpy(delta[name].numpy()))
        except (ValueError, IndexError, RuntimeError) as error:
            raise SecAggError(f"array {name!r} does not fit its assigned slice: {error}") from None
        values.append(full.numpy().ravel())
        weights.append(sl.mask(shape).numpy().ravel().astype(np.int64) * weight)
    return np.concatenate(values), np.concatenate(weights)


def _secagg_record(message: Message) -> ConfigRecord:
    record = message.content.get(protocol.SECAGG_RECORD) if protocol.SECAGG_RECORD in message.content else None
    if not isinstance(record, ConfigRecord):
        raise SecAggError(f"a {message.metadata.message_type} message without its secure-aggregation record")
    return record


def _save(context: Context, session: SiteSession) -> None:
    context.state[STATE_KEY]["session"] = session.to_state()


def _load(context: Context) -> SiteSession:
    if STATE_KEY not in context.state or "session" not in context.state[STATE_KEY]:
        raise SecAggError(f"site {context.node_id}: a secure-aggregation message before the round's setup")
    return SiteSession.from_state(str(context.state[STATE_KEY]["session"]), _identity(context))


def _identity(context: Context) -> SiteIdentity:
    if IDENTITY_KEY not in context.state:
        raise SecAggError(f"site {context.node_id} has no secure-aggregation identity: start it with "
                          "--secagg-identity FILE (`hydrafl admin site add --consortium-key` writes one)")
    return SiteIdentity.from_json(str(context.state[IDENTITY_KEY]["identity"]))
