"""The one error a bad configuration value raises, and the check that words it, shared by the run-wide
configuration and every strategy's knobs (torch-free, so both validate before anything is loaded)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it and the valid choices."""


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming `key` (as its flag is spelled), the value seen and what is expected."""
    if not ok:
        raise ConfigError(f"invalid --{key}={value!r}: expected {expected}")
