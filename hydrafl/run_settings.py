"""The run's settings as a site reads them: once per run, from its Context, never from each message.

The run-wide keys (Flower's flat `run_config`) reach a site's `Context.run_config` once per run: the site agent
asks the coordinator when it joins a run, the in-process grid builds each site's Context with them, and on
Flower's Ray engine, which gives sites none, `PipelineApp` sets them (the one place they are flattened for a
runtime). A message carries only what changes per round: its round, the site's subnetwork, its LoRA rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Message

from hydrafl.updates import records


def message_keys(message: Message) -> ConfigRecord:
    """The per-round keys the coordinator sent with this message (empty when it sent none)."""
    return next(iter(records(message.content, ConfigRecord)), ConfigRecord())


def run_settings(message: Message, context: Context) -> Mapping[str, Any]:
    """The run's settings and this message's per-round keys, side by side (the message's win a clash)."""
    return {**context.run_config, **message_keys(message)}
