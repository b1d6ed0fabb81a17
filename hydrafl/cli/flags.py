"""Configuration keys as command-line flags: `--key value`, `--key=value`, `--flag` / `--no-flag` for booleans.

Every key of a run, of a comparison and of every strategy's knobs is a flag without being listed here: the
dataclass fields that define the keys (`hydrafl.config`, each strategy's config) are the one source of truth,
for their types as for their help (`hydrafl keys`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydrafl.validation import ConfigError

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_flags(args: list[str], key_type: Callable[[str], str | None]) -> dict[str, Any]:
    """`args` as {key: typed value}. A key `key_type` does not know stays a string, so the configuration
    refuses it by name with the valid keys."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(
                f"unexpected argument {token!r}: options are --key value (see `hydrafl keys`)"
            )
        key, _, inline = token[2:].partition("=")
        kind = key_type(key)
        if kind is None and key.startswith("no-") and key_type(key[3:]) == "bool" and not inline:
            values[key[3:]] = False
            i += 1
            continue
        if kind == "bool" and not inline and (i + 1 == len(args) or args[i + 1].startswith("--")):
            values[key] = True
            i += 1
            continue
        if inline:
            text, i = inline, i + 1
        elif i + 1 < len(args):
            text, i = args[i + 1], i + 2
        else:
            raise ConfigError(f"--{key} needs a value")
        values[key] = _convert(key, text, kind)
    return values


def _convert(key: str, text: str, kind: str | None) -> Any:
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ConfigError(
            f"--{key} must be {'an integer' if kind == 'int' else 'a number'}, got {text!r}"
        ) from None
    if kind == "bool":
        if text.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"--{key} must be true or false, got {text!r}")
        return text.lower() in _TRUE
    return text
