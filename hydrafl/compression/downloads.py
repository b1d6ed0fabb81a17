"""Compressed downloads with error feedback kept at the coordinator (`--compress-downloads`).

The coordinator and each site share a reference model x_hat. A train or evaluate message carries
c = C(x - x_hat) in the run's scheme, and both ends set x_hat += D(c): what compression lost stays in x - x_hat and
travels in later messages (EF21-P, Gruntkowska et al., 2023; DoubleSqueeze, Tang et al., 2019). The site trains
and evaluates x_hat; the coordinator applies its update to x. Both ends hash x_hat (`content_hash`): a message
names the reference it builds on (`base`) and the one it makes (`target`), and the site refuses what it cannot
rebuild exactly (`hydrafl.compression.reference`).

A site is sent the whole model instead, which becomes its reference, when the coordinator knows of no usable
reference it holds: at first contact, after it failed or did not answer its last message, when it took part in
neither the previous round nor this one (stale), when its subnetwork or LoRA rank changed (other coordinates),
and after a coordinator restart (references are not checkpointed: a resumed run's first messages go whole). A
site holds a reference once it answers a message built on it without error, one per coordinates it was sent (a
Hydra-net site its subnetwork's slices to train and the whole model to evaluate; the site keeps its last
`SITE_REFERENCES`). The last round's evaluation goes
whole, so a run's final metrics are those of the model it saves. A message without exactly one ArrayRecord, all
float32, travels as it is. Each distinct reference is kept once: sites sent the same messages share it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from hydrafl.arrays import from_record, to_record
from hydrafl.compression.codecs import decode, encode
from hydrafl.compression.feedback import coordinates_key
from hydrafl.compression.layout import DOWNLOAD_RECORD, Scheme, describe
from hydrafl.updates import records

FULL, DELTA = "full", "delta"
"""A download's `mode`: the whole model, or the compressed change from the site's reference."""
SITE_REFERENCES = 4
"""References a site keeps, the most recently rebuilt: a train and an evaluate message's in each of the two rounds
the coordinator builds on."""

Tensors = dict[str, torch.Tensor]


def content_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the names, shapes and float32 bits in order: equal digests, the same model."""
    digest = hashlib.sha256(
        json.dumps([[name, list(t.shape)] for name, t in tensors.items()]).encode()
    )
    for tensor in tensors.values():
        digest.update(tensor.detach().to(torch.float32).contiguous().reshape(-1).numpy().data)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class _Held:
    """A reference a site holds, or will hold once it answers the message that carries it."""

    digest: str
    key: str
    """The coordinates it was sent for: the subnetwork and LoRA rank (`feedback.coordinates_key`)."""
    server_round: int


class DownloadCompression:
    """The coordinator's side: each site's reference, the messages it waits on, the reference models by digest."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.models: dict[str, Tensors] = {}
        self.warm: dict[str, Tensors] = {}
        """PowerSGD: per reference, each matrix's Q for the next change built on it."""
        self.held: dict[tuple[int, str], _Held] = {}
        """Per site and coordinates key, the reference it holds."""
        self.pending: dict[int, _Held] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DownloadCompression:
        """On with the run's `compress-downloads`, in its upload scheme; a no-op otherwise."""
        return cls(Scheme.from_config(config) if config.get("compress-downloads") else Scheme())

    def prepare(
        self, messages: Sequence[Message], server_round: int, *, full: bool = False
    ) -> list[Message]:
        """The messages as they go on the wire: each model compressed against the reference its site holds, or
        whole (its new reference) when it holds none usable, or with `full`. Sites given the same model from the
        same reference share one encoding."""
        if not self.scheme.enabled:
            return list(messages)
        built: dict[tuple[str, int], tuple[ArrayRecord, ConfigRecord]] = {}
        wire = []
        for place in [
            place for place, held in self.held.items() if held.server_round < server_round - 1
        ]:
            del self.held[place]  # stale: nothing more is built on it
        for message in messages:
            node, content = message.metadata.dst_node_id, message.content
            names = [name for name, record in content.items() if isinstance(record, ArrayRecord)]
            if len(names) != 1 or any(
                array.dtype != "float32" for array in content.array_records[names[0]].values()
            ):
                wire.append(message)
                continue
            if node in self.pending:  # a message it never answered: what it holds is unknown
                self._forget(node)
            key = coordinates_key(
                next(iter(records(content, ConfigRecord)), ConfigRecord()), self.scheme
            )
            arrays, held = content.array_records[names[0]], self.held.get((node, key))
            usable = (
                held is not None and not full and _same_layout(self.models[held.digest], arrays)
            )
            base = held.digest if held is not None and usable else ""
            if (base, id(arrays)) not in built:
                built[base, id(arrays)] = self._delta(base, arrays) if base else self._full(arrays)
            sent, download = built[base, id(arrays)]
            self.pending[node] = _Held(str(download["target"]), key, server_round)
            wire_content = RecordDict(
                {name: sent if name == names[0] else record for name, record in content.items()}
            )
            wire_content[DOWNLOAD_RECORD] = download
            metadata = message.metadata
            wire.append(
                Message(
                    wire_content,
                    dst_node_id=node,
                    message_type=metadata.message_type,
                    group_id=metadata.group_id,
                    ttl=metadata.ttl,
                )
            )
        return wire

    def settle(self, messages: Sequence[Message], replies: Iterable[Message]) -> Iterator[Message]:
        """`replies` as they come, noting that each site that answered without error holds the reference its
        message made; any other site sent one is forgotten (its next message goes whole)."""
        waiting = {message.metadata.dst_node_id for message in messages} & self.pending.keys()
        for reply in replies:
            node = reply.metadata.src_node_id
            if node in waiting:
                waiting.discard(node)
                if reply.has_error():
                    self._forget(node)
                else:
                    held = self.pending.pop(node)
                    self.held[node, held.key] = held
            yield reply
        for node in waiting:
            self._forget(node)
        used = {held.digest for held in (*self.held.values(), *self.pending.values())}
        for digest in set(self.models) - used:
            del self.models[digest]
            self.warm.pop(digest, None)

    def _full(self, arrays: ArrayRecord) -> tuple[ArrayRecord, ConfigRecord]:
        digest = self._keep(from_record(arrays), {})
        return arrays, ConfigRecord({"mode": FULL, "target": digest})

    def _delta(self, base: str, arrays: ArrayRecord) -> tuple[ArrayRecord, ConfigRecord]:
        """C(x - x_hat), and x_hat + D(C(x - x_hat)) kept as the reference it makes (rebuilt as the site will)."""
        reference = self.models[base]
        change = {
            name: torch.from_numpy(array.numpy()) - reference[name]
            for name, array in arrays.items()
        }
        encoded = encode(change, self.scheme, self.warm.get(base))
        decoded = decode(encoded.arrays, encoded.shapes, self.scheme, exact=True)
        digest = self._keep(
            {name: reference[name] + decoded[name] for name in reference},
            {**self.warm.get(base, {}), **encoded.warm},
        )
        download = {
            "mode": DELTA,
            "base": base,
            "target": digest,
            **describe(self.scheme, encoded.shapes),
        }
        return to_record(encoded.arrays), ConfigRecord(download)

    def _keep(self, model: Tensors, warm: Tensors) -> str:
        digest = content_hash(model)
        self.models.setdefault(digest, model)
        self.warm.setdefault(digest, warm)
        return digest

    def _forget(self, node: int) -> None:
        """What `node` holds for the coordinates of its unanswered message is unknown (it may have rebuilt it)."""
        if (held := self.pending.pop(node, None)) is not None:
            self.held.pop((node, held.key), None)


def _same_layout(reference: Tensors, arrays: ArrayRecord) -> bool:
    """The same tensors in the same order, of the same shapes: a change between them is defined."""
    return [(name, tuple(t.shape)) for name, t in reference.items()] == [
        (name, tuple(array.shape)) for name, array in arrays.items()
    ]
