"""The minimum-success rule: a training round with fewer valid replies than required fails the run loudly
(its model is discarded) instead of silently keeping old weights."""

from __future__ import annotations

from hydrafl.rounds import RoundRecord


class RoundFailed(RuntimeError):
    """Too few sites answered a round without error; the run stops instead of silently keeping old weights."""


def require_sites(server_round: int, sent: int, required: int, record: RoundRecord) -> None:
    """On the valid replies counted so far in `record` of the `sent` messages: RoundFailed below `required`."""
    record.sites_failed = sent - record.sites_ok
    if record.sites_ok < required:
        raise RoundFailed(
            f"round {server_round}: only {record.sites_ok} of {sent} sites replied without error, "
            f"{required} required (min_sites); the run stops with the round-"
            f"{server_round - 1} model saved"
        )
