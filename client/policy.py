"""The site operator's policy: which runs the site joins, and what an update must look like before it
leaves the site (L2 clipping, optional Gaussian noise).

The policy is applied by the site agent to the ClientApp's reply, after the app returns and before upload,
so nothing the coordinator sends (run config, strategy) can switch it off. An invalid policy file stops the
site before it connects: it fails closed.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Message

from hydrafl.configfile import load_toml
from hydrafl.validation import ConfigError

KEYS = {"allowed-runs", "allowed-strategies", "max-update-norm", "noise-multiplier"}


class PolicyError(ValueError):
    """The policy file is missing or invalid; the site refuses to start."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SitePolicy:
    allowed_runs: tuple[int, ...] | None = None
    """Run ids this site may join; None allows every run."""
    allowed_strategies: tuple[str, ...] | None = None
    max_update_norm: float | None = None
    """L2 bound on a training update (all arrays together); larger updates are scaled down to it."""
    noise_multiplier: float = 0.0
    """Gaussian noise of std noise_multiplier * max_update_norm added to every coordinate after clipping."""

    def __post_init__(self) -> None:
        if self.max_update_norm is not None and not (math.isfinite(self.max_update_norm) and self.max_update_norm > 0):
            raise PolicyError(f"max-update-norm must be a positive number, got {self.max_update_norm!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise PolicyError(f"noise-multiplier must be >= 0, got {self.noise_multiplier!r}")
        if self.noise_multiplier and self.max_update_norm is None:
            raise PolicyError("noise-multiplier needs max-update-norm (noise is calibrated to the clipping bound)")

    def refusal(self, run_id: int, strategy: str) -> str:
        """Why this site refuses to work for the run, or "" when it may."""
        if self.allowed_runs is not None and run_id not in self.allowed_runs:
            return f"site policy does not allow run {run_id}"
        if self.allowed_strategies is not None and strategy not in self.allowed_strategies:
            return f"site policy does not allow strategy {strategy!r}"
        return ""

    def apply(self, reply: Message) -> Message:
        """Clip (and noise) the arrays of a training reply in place; other replies pass unchanged."""
        if self.max_update_norm is None or reply.has_error() or not reply.metadata.message_type.startswith("train"):
            return reply
        for key, record in list(reply.content.items()):
            if isinstance(record, ArrayRecord):
                reply.content[key] = self._privatise(record)
        return reply

    def _privatise(self, record: ArrayRecord) -> ArrayRecord:
        values = {name: array.numpy().astype(np.float64) for name, array in record.items()}
        norm = math.sqrt(sum(float((v**2).sum()) for v in values.values()))
        scale = min(1.0, self.max_update_norm / norm) if norm > 0 else 1.0
        rng = np.random.default_rng(secrets.randbits(128))
        std = self.noise_multiplier * self.max_update_norm
        out = {}
        for name, value in values.items():
            private = value * scale + (rng.normal(0.0, std, size=value.shape) if std else 0.0)
            out[name] = Array(private.astype(record[name].dtype))
        return ArrayRecord(out)


def load_policy(path: str | Path) -> SitePolicy:
    path = Path(path)
    try:
        values = load_toml(path, what="policy file")
    except ConfigError as error:
        raise PolicyError(str(error)) from error
    except OSError as error:  # a directory, no permission: one line that says so, never a traceback
        raise PolicyError(f"policy file {str(path)!r} cannot be read: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise PolicyError(f"policy file {str(path)!r} is not UTF-8 text") from error
    unknown = sorted(set(values) - KEYS)
    if unknown:
        raise PolicyError(f"unknown key {unknown[0]!r} in {path}; valid keys: {', '.join(sorted(KEYS))}")
    try:
        return SitePolicy(
            allowed_runs=_tuple(values, "allowed-runs", int),
            allowed_strategies=_tuple(values, "allowed-strategies", str),
            max_update_norm=_number(values.get("max-update-norm")),
            noise_multiplier=_number(values.get("noise-multiplier", 0.0)),
        )
    except PolicyError as error:
        raise PolicyError(f"{path}: {error}") from error


def _tuple(values: dict, key: str, kind: type) -> tuple | None:
    if key not in values:
        return None
    items = values[key]
    if not isinstance(items, list) or not all(isinstance(item, kind) and not isinstance(item, bool) for item in items):
        raise PolicyError(f"{key} must be a list of {kind.__name__}, got {items!r}")
    return tuple(items)


def _number(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"expected a number, got {value!r}")
    return float(value)
