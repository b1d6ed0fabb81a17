"""The site operator's policy: which runs the site joins, what an update must look like before it leaves the
site (L2 clipping, optional Gaussian noise), and how much privacy the site will spend (`max-epsilon`).

The site accounts its own noise (local DP) with the same accountant as the coordinator, over its
participations kept in the run's persistent `context.state`, and reports its epsilon with every train reply.
Before training it checks the round against its budget: the run's spending after the round (the epsilon the
train message carries; absent = no central DP = infinite), or with its own noise the smaller of that and its
own epsilon after the round. Over budget, or anything it cannot read, it refuses: fail closed.

Cohort statistics (`query.stats`, `hydrafl.cohort_stats`) leave as counts released by the policy: noised first
when `stats-epsilon` is set (Laplace, or Gaussian at `delta`), then every cell of 1 to `min-cell-count` - 1
suppressed.

Small-cell suppression (`min-class-count`): before training, the site counts the records per class of its
training split and refuses while any class has 1 to min-class-count - 1 of them. The refusal that leaves the
site names only the rule; the class and its count, themselves the small cell, stay in the site's log.

The policy is applied by the site agent to the ClientApp's reply, after the app returns and before upload,
so nothing the coordinator sends (run config, strategy) can switch it off. An invalid policy file stops the
site before it connects: it fails closed.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.common.constant import ErrorCode

from hydrafl import protocol
from hydrafl.cohort_stats import MECHANISMS, SiteStats, release
from hydrafl.configfile import load_toml
from hydrafl.validation import ConfigError

log = logging.getLogger(__name__)

KEYS = {
    "allowed-apps",
    "allowed-runs",
    "allowed-strategies",
    "max-update-norm",
    "noise-multiplier",
    "max-epsilon",
    "delta",
    "min-class-count",
    "min-cell-count",
    "stats-epsilon",
    "stats-noise",
}
SMALL_CELL_REASON = (
    "site policy min-class-count: this site's training data has a class with too few records (which, and how "
    "many, only in the site's log)"
)
"""What a small-cell refusal tells the coordinator: the class and its count would disclose the small cell."""
PRIVACY_STATE = "site-privacy"
"""The `context.state` ConfigRecord where the site counts its noised replies (`participations`)."""


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
    max_epsilon: float | None = None
    """The site's privacy budget: it refuses a round that would spend more (None: no budget)."""
    delta: float = 1e-5
    """The delta of the site's own epsilon."""
    min_class_count: int | None = None
    """Small-cell suppression: the site refuses to train while a class of its training split has 1 to
    min_class_count - 1 records (None: no minimum)."""
    min_cell_count: int = 0
    """Cohort statistics: a count of 1 to min_cell_count - 1 records is suppressed (0: none)."""
    stats_epsilon: float | None = None
    """Cohort statistics: noise the counts for this epsilon in all (None: released exact)."""
    stats_noise: str = "laplace"
    """Cohort statistics: laplace, or gaussian (for (stats-epsilon, delta))."""
    allowed_apps: tuple[str, ...] = ()
    """SHA-256 digests (hex) of the Flower app bundles this site runs when a run ships one; none by default."""

    def __post_init__(self) -> None:
        if self.max_update_norm is not None and not (
            math.isfinite(self.max_update_norm) and self.max_update_norm > 0
        ):
            raise PolicyError(
                f"max-update-norm must be a positive number, got {self.max_update_norm!r}"
            )
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise PolicyError(f"noise-multiplier must be >= 0, got {self.noise_multiplier!r}")
        if self.noise_multiplier and self.max_update_norm is None:
            raise PolicyError(
                "noise-multiplier needs max-update-norm (noise is calibrated to the clipping bound)"
            )
        if self.max_epsilon is not None and not (
            math.isfinite(self.max_epsilon) and self.max_epsilon > 0
        ):
            raise PolicyError(f"max-epsilon must be a positive number, got {self.max_epsilon!r}")
        if not 0 < self.delta < 1:
            raise PolicyError(f"delta must be in (0, 1), got {self.delta!r}")
        bad = next((d for d in self.allowed_apps if not re.fullmatch(r"[0-9a-f]{64}", d)), None)
        if bad is not None:
            raise PolicyError(f"allowed-apps: {bad[:80]!r} is not a SHA-256 digest (64 hex digits)")
        if self.min_class_count is not None and self.min_class_count < 2:
            raise PolicyError(
                f"min-class-count must be an integer >= 2, got {self.min_class_count!r}"
            )

        if self.min_cell_count < 0:
            raise PolicyError(
                f"min-cell-count must be an integer >= 0, got {self.min_cell_count!r}"
            )
        if self.stats_epsilon is not None and not (
            math.isfinite(self.stats_epsilon) and self.stats_epsilon > 0
        ):
            raise PolicyError(
                f"stats-epsilon must be a positive number, got {self.stats_epsilon!r}"
            )
        if self.stats_noise not in MECHANISMS:
            raise PolicyError(
                f"stats-noise must be {' or '.join(MECHANISMS)}, got {self.stats_noise!r}"
            )
        if self.stats_noise == "gaussian" and (self.stats_epsilon or 0) >= 1:
            raise PolicyError(
                "stats-noise gaussian is the classic mechanism, valid for stats-epsilon < 1; lower it or "
                "use laplace"
            )

    def refusal(self, run_id: int, strategy: str) -> str:
        """Why this site refuses to work for the run, or "" when it may."""
        if self.allowed_runs is not None and run_id not in self.allowed_runs:
            return f"site policy does not allow run {run_id}"
        if self.allowed_strategies is not None and strategy not in self.allowed_strategies:
            return f"site policy does not allow strategy {strategy!r}"
        return ""

    def app_refusal(self, digest: str) -> str:
        """Why this site will not run the app bundle of this SHA-256, or "" when it may."""
        if digest in self.allowed_apps:
            return ""
        return (
            f"site policy does not allow app bundle sha256:{digest}; the site's operator allows it with "
            f"allowed-apps in the policy file or --allow-app {digest}"
        )

    def budget_refusal(self, message: Message, context: Context) -> str:
        """Why the site will not train this round for its privacy budget, or "" when it may."""
        if self.max_epsilon is None or not message.metadata.message_type.startswith("train"):
            return ""
        spend = _run_epsilon(message)
        if self.noise_multiplier:
            spend = min(spend, self.local_epsilon(_participations(context) + 1))
        if spend <= self.max_epsilon:
            return ""
        shown = "no central DP, infinite" if math.isinf(spend) else f"{spend:.4g}"
        return (
            f"privacy budget: this round would bring the site's epsilon to {shown}, "
            f"over its max-epsilon {self.max_epsilon:g}"
        )

    def small_cell_refusal(self, counts: Mapping[str, int]) -> str:
        """Why the site will not train on a split with these records per class, or "" when it may. For the
        site's log only: it names classes and counts, the very cells it suppresses (SMALL_CELL_REASON leaves).

        A class with no records is not a small cell (usual small-cell rules suppress 1..k-1): a count of zero
        discloses no one, and a non-IID site often lacks some of the task's classes."""
        if self.min_class_count is None:
            return ""
        if not counts:
            return "min-class-count counts records per class, and this run's task has no class labels; remove the key"
        small = [
            f"class {name!r} has {count}"
            for name, count in counts.items()
            if 0 < count < self.min_class_count
        ]
        if not small:
            return ""
        return (
            f"small cells: {', '.join(small)} training record(s), under the policy's min-class-count "
            f"{self.min_class_count}; add records of that class, merge it into another, or lower min-class-count"
        )

    def decline(self, message: Message, reason: str) -> Message:
        """The error reply of a refused round (the coordinator audits it as site-declined)."""
        log.warning("declining a %s message: %s", message.metadata.message_type, reason)
        return Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, reason), reply_to=message)

    def local_epsilon(self, participations: int) -> float:
        """The site's own epsilon after `participations` noised replies (inf without noise)."""
        from hydrafl.privacy.accountant import (
            local_epsilon,
        )  # dp-accounting only for a site that adds noise

        return local_epsilon(self.noise_multiplier, participations, delta=self.delta)

    def release(self, reply: Message, context: Context) -> Message:
        """The reply as it may leave: clipped and noised (`apply`); a noised train reply counts as a
        participation and reports the site's epsilon in its ConfigRecord."""
        if reply.metadata.message_type == protocol.QUERY_STATS and not reply.has_error():
            return self.release_stats(reply)
        reply = self.apply(reply)
        if (
            not self.noise_multiplier
            or reply.has_error()
            or not reply.metadata.message_type.startswith("train")
        ):
            return reply
        count = _participations(context) + 1
        context.state[PRIVACY_STATE] = ConfigRecord({"participations": count})
        if not reply.content.config_records:
            reply.content["privacy"] = ConfigRecord()
        next(iter(reply.content.config_records.values()))[protocol.LOCAL_EPSILON] = (
            self.local_epsilon(count)
        )
        return reply

    def release_stats(self, reply: Message) -> Message:
        """A statistics reply with its counts released (`cohort_stats.release`)."""
        record = reply.content.config_records[protocol.STATS_RECORD]
        released = release(
            SiteStats.from_json(str(record[protocol.STATS_REPORT])),
            min_cell_count=self.min_cell_count,
            mechanism=self.stats_noise if self.stats_epsilon else "",
            epsilon=self.stats_epsilon or 0.0,
            delta=self.delta,
            rng=np.random.default_rng(secrets.randbits(128)),
        )
        record[protocol.STATS_REPORT] = released.to_json()
        return reply

    def apply(self, reply: Message) -> Message:
        """Clip (and noise) the arrays of a training reply in place; other replies pass unchanged."""
        if (
            self.max_update_norm is None
            or reply.has_error()
            or not reply.metadata.message_type.startswith("train")
        ):
            return reply
        for key, record in list(reply.content.items()):
            if isinstance(record, ArrayRecord):
                reply.content[key] = self._privatise(record, self.max_update_norm)
        return reply

    def _privatise(self, record: ArrayRecord, bound: float) -> ArrayRecord:
        values = {name: array.numpy().astype(np.float64) for name, array in record.items()}
        norm = math.sqrt(sum(float((v**2).sum()) for v in values.values()))
        scale = min(1.0, bound / norm) if norm > 0 else 1.0
        rng = np.random.default_rng(secrets.randbits(128))
        std = self.noise_multiplier * bound
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
        raise PolicyError(
            f"policy file {str(path)!r} cannot be read: {error.strerror or error}"
        ) from error
    except UnicodeDecodeError as error:
        raise PolicyError(f"policy file {str(path)!r} is not UTF-8 text") from error
    unknown = sorted(set(values) - KEYS)
    if unknown:
        raise PolicyError(
            f"unknown key {unknown[0]!r} in {path}; valid keys: {', '.join(sorted(KEYS))}"
        )
    try:
        return SitePolicy(
            allowed_runs=_tuple(values, "allowed-runs", int),
            allowed_strategies=_tuple(values, "allowed-strategies", str),
            max_update_norm=_number(values.get("max-update-norm")),
            noise_multiplier=_number_or(values.get("noise-multiplier"), 0.0),
            max_epsilon=_number(values.get("max-epsilon")),
            delta=_number_or(values.get("delta"), 1e-5),
            min_class_count=_integer(values, "min-class-count"),
            min_cell_count=_integer(values, "min-cell-count") or 0,
            stats_epsilon=_number(values.get("stats-epsilon")),
            stats_noise=str(values.get("stats-noise", "laplace")),
            allowed_apps=_tuple(values, "allowed-apps", str) or (),
        )
    except PolicyError as error:
        raise PolicyError(f"{path}: {error}") from error


def _run_epsilon(message: Message) -> float:
    """The run's spending after this round as the train message states it; absent or unreadable: infinite."""
    for config in message.content.config_records.values():
        value = config.get(protocol.RUN_EPSILON)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return math.inf


def _participations(context: Context) -> int:
    record = context.state.config_records.get(PRIVACY_STATE)
    return int(record["participations"]) if record is not None else 0


def _tuple(values: dict, key: str, kind: type) -> tuple | None:
    if key not in values:
        return None
    items = values[key]
    if not isinstance(items, list) or not all(
        isinstance(item, kind) and not isinstance(item, bool) for item in items
    ):
        raise PolicyError(f"{key} must be a list of {kind.__name__}, got {items!r}")
    return tuple(items)


def _integer(values: dict, key: str) -> int | None:
    value = values.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise PolicyError(f"{key} must be an integer, got {value!r}")
    return value


def _number_or(value: object, default: float) -> float:
    number = _number(value)
    return default if number is None else number


def _number(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"expected a number, got {value!r}")
    return float(value)
