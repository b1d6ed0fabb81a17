"""Flat TOML files of options, read without loading any model code.

The command line, the coordinator's options and the site policy read theirs here, so none of them imports the
run configuration (and with it the strategies, torch and Flower) just to parse a file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from hydrafl.validation import ConfigError


def load_toml(path: str | Path, *, what: str = "config file") -> dict[str, Any]:
    """Read a flat TOML file (nested tables are an error: every key is a flag); `what` names it in errors."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{what} {str(path)!r} is not valid TOML: {error}") from error
    for key, value in values.items():
        if isinstance(value, dict):
            raise ConfigError(
                f"unknown key {key!r} in {path}: tables are not supported, use flat keys"
            )
    return values
