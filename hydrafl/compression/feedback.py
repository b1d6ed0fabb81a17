"""Error feedback at the site: what compression loses is kept and added to the next round's update.

Each round the site sends C(u + e) and keeps e' = u + e - D(C(u + e)), so the sum of what the coordinator
decodes over rounds is the sum of the true updates minus the last residual (Karimireddy et al., 2019; Vogels et
al., 2019 for PowerSGD's warm-started Q, kept here too). The residuals live in the run's persistent
`context.state` (every runtime keeps it per node across messages) and, for a site with a state directory
(`hydrafl site --state-dir`), in a file there too, so they survive a restart of the site.

A residual belongs to the coordinates it was made over: when a round's subnetwork or LoRA rank differs from
the last one (its `hydra.*` and `lora.site-rank` keys), the residuals start again from zero rather than being
added to other coordinates.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from hydrafl import protocol
from hydrafl.arrays import from_record, to_record
from hydrafl.compression.codecs import decode, encode
from hydrafl.compression.layout import RECORD, Scheme, describe
from hydrafl.run_settings import run_settings
from hydrafl.site_config import SiteConfig

STATE_ARRAYS = "compress.feedback"
"""The `context.state` ArrayRecord of residuals (`e/NAME`) and PowerSGD warm starts (`q/NAME`)."""
STATE_CONFIG = "compress.feedback-key"
"""The `context.state` ConfigRecord naming what the residuals were made over (`key`)."""


class ErrorFeedback:
    """One site's residuals and warm starts for one run."""

    def __init__(
        self, key: str, residuals: dict[str, torch.Tensor], warm: dict[str, torch.Tensor]
    ) -> None:
        self.key = key
        self.residuals = residuals
        self.warm = warm

    def compress(
        self, update: Mapping[str, torch.Tensor], scheme: Scheme
    ) -> tuple[ArrayRecord, ConfigRecord]:
        """The wire form of `update` plus the residual, keeping the new residual."""
        corrected = {}
        for name, tensor in update.items():
            tensor = tensor.detach().to(torch.float32)
            residual = self.residuals.get(name)
            corrected[name] = (
                tensor + residual
                if residual is not None and residual.shape == tensor.shape
                else tensor
            )
        encoded = encode(corrected, scheme, self.warm)
        decoded = decode(encoded.arrays, encoded.shapes, scheme)
        self.residuals = {name: corrected[name] - decoded[name] for name in corrected}
        self.warm = {**self.warm, **encoded.warm}
        return to_record(encoded.arrays), ConfigRecord(describe(scheme, encoded.shapes))

    @classmethod
    def load(cls, context: Context, state_dir: Path | None, key: str) -> ErrorFeedback:
        """The residuals kept in `context.state`, else in `state_dir` (a restarted site); empty when they were
        made over other coordinates than `key` says (warm starts are kept: they are only a starting point)."""
        if STATE_ARRAYS in context.state:
            saved_key = str(context.state[STATE_CONFIG]["key"])
            tensors = from_record(context.state[STATE_ARRAYS])
        elif (
            state_dir is not None and (path := state_path(state_dir, context, "feedback")).exists()
        ):
            saved_key, tensors = read_state(path)
        else:
            return cls(key, {}, {})
        residuals = (
            {n[2:]: t for n, t in tensors.items() if n.startswith("e/")} if saved_key == key else {}
        )
        return cls(key, residuals, {n[2:]: t for n, t in tensors.items() if n.startswith("q/")})

    def save(self, context: Context, state_dir: Path | None) -> None:
        tensors = {f"e/{n}": t for n, t in self.residuals.items()} | {
            f"q/{n}": t for n, t in self.warm.items()
        }
        context.state[STATE_ARRAYS] = to_record(tensors)
        context.state[STATE_CONFIG] = ConfigRecord({"key": self.key})
        if state_dir is not None:
            write_state(state_path(state_dir, context, "feedback"), self.key, tensors)


def compress_reply(message: Message, reply: Message, context: Context) -> Message:
    """A train reply in the wire form the message's run config asks for (unchanged when it asks for none, or
    for an error reply); the residual is kept for the next round, also in the site's `state-dir` if it has one."""
    if reply.has_error() or not message.metadata.message_type.startswith("train"):
        return reply
    config = run_settings(message, context)
    scheme = Scheme.from_config(config)
    if not scheme.enabled:
        return reply
    [key] = [k for k, record in reply.content.items() if isinstance(record, ArrayRecord)]
    state_dir = SiteConfig.from_node_config(context.node_config).state_dir
    feedback = ErrorFeedback.load(context, state_dir, coordinates_key(config, scheme))
    arrays, description = feedback.compress(from_record(reply.content[key]), scheme)
    feedback.save(context, state_dir)
    reply.content[key] = arrays
    reply.content[RECORD] = description
    return reply


def coordinates_key(config: Mapping, scheme: Scheme) -> str:
    """What a round's residuals are made over: the scheme, the subnetwork and the LoRA rank the message assigns."""
    assigned = {
        k: v
        for k, v in config.items()
        if k.startswith(protocol.SUBNET_PREFIX) or k == protocol.SITE_RANK
    }
    text = json.dumps([repr(scheme), sorted(assigned.items())], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def state_path(state_dir: Path, context: Context, what: str) -> Path:
    """The file of one run's compression state of kind `what` in a site's `--state-dir`."""
    return state_dir / f"compress-{what}-run-{context.run_id}.npz"


def write_state(path: Path, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """`tensors` and the `key` naming what they belong to, replacing the file whole: a site killed mid-write
    keeps the previous round's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, key=np.array(key), **{n: t.numpy() for n, t in tensors.items()})
    os.replace(partial, path)


def read_state(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """What `write_state` wrote: the key and the tensors."""
    with np.load(path, allow_pickle=False) as saved:
        return str(saved["key"]), {
            name: torch.from_numpy(saved[name]) for name in saved.files if name != "key"
        }
