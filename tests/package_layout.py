"""Which checkout folder each package of `hydrafl` comes from, read from pyproject's
`[tool.setuptools.package-dir]`: the one place the mapping is written."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, str]:
    """Top-level folder -> the package it is installed as (`server` -> `hydrafl.server`)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    return {folder: package for package, folder in mapping.items()}
