"""Flower app bundles (FABs): a Flower app project as `flwr build` packs it, named by the SHA-256 of its bytes.

`hydrafl admin run create --app DIR|FILE.fab` builds or reads one; the coordinator stores it with the run, runs
its ServerApp and ships it to the sites on Join; a site runs its ClientApp only when its policy lists the digest
(`allowed_apps`). A bundle is unpacked with every path checked to stay in its folder and its size bounded, and
its `[project] dependencies` are checked against what is installed, never installed.
"""

from __future__ import annotations

import hashlib
import io
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MAX_BUNDLE_BYTES = 4 << 20
"""A bundle travels inline (an admin call, a site's Join): a Flower app's code is kilobytes."""
MAX_UNPACKED_BYTES = 64 << 20
MAX_FILES = 2_000


class BundleError(ValueError):
    """A bundle that cannot be used; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class AppBundle:
    data: bytes
    digest: str
    """SHA-256 of `data`, hex: what a site's policy allows."""
    server_app: str
    client_app: str
    config: dict[str, Any]
    """`[tool.flwr.app.config]`, flattened as Flower flattens it: the run_config's defaults."""


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bundle(data: bytes) -> AppBundle:
    """The bundle's components and config defaults, from its pyproject.toml as Flower validates it."""
    from flwr.common.config import flatten_dict, get_fab_config

    if len(data) > MAX_BUNDLE_BYTES:
        raise BundleError(f"the app bundle has {len(data)} bytes; at most {MAX_BUNDLE_BYTES}")
    try:
        config = get_fab_config(data)
    except (zipfile.BadZipFile, KeyError, ValueError, UnicodeDecodeError) as error:
        raise BundleError(f"not a Flower app bundle: {' '.join(str(error).split())}") from None
    app = config["tool"]["flwr"]["app"]
    components = app["components"]
    return AppBundle(
        data=data,
        digest=digest_of(data),
        server_app=str(components["serverapp"]),
        client_app=str(components["clientapp"]),
        config=flatten_dict(app.get("config", {})),
    )


def load_bundle(path: Path) -> AppBundle:
    """A Flower app project folder, built as `flwr build` builds it, or a `.fab` file it built."""
    if path.is_dir():
        from flwr.cli.build import build_fab_from_disk

        if not (path / "pyproject.toml").is_file():
            raise BundleError(f"--app {path} has no pyproject.toml: not a Flower app project")
        try:
            return read_bundle(build_fab_from_disk(path))
        except (OSError, ValueError) as error:
            raise BundleError(f"--app {path}: {' '.join(str(error).split())}") from None
    try:
        return read_bundle(path.read_bytes())
    except OSError as error:
        raise BundleError(f"cannot read --app {path}: {error.strerror or error}") from None


def unpack(data: bytes, folder: Path) -> Path:
    """Extract the bundle into `folder` (created), refusing absolute paths, `..`, links and more than
    MAX_FILES files or MAX_UNPACKED_BYTES bytes, before anything is written."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        if len(members) > MAX_FILES:
            raise BundleError(f"the app bundle holds {len(members)} files; at most {MAX_FILES}")
        if sum(member.file_size for member in members) > MAX_UNPACKED_BYTES:
            raise BundleError(f"the app bundle unpacks to over {MAX_UNPACKED_BYTES} bytes")
        for member in members:
            name = PurePosixPath(member.filename)
            if name.is_absolute() or ".." in name.parts or "\\" in member.filename:
                raise BundleError(f"the app bundle holds a path outside its folder: {name}")
            if (member.external_attr >> 16) & 0o170000 == 0o120000:
                raise BundleError(f"the app bundle holds a link: {name}")
        folder.mkdir(parents=True, exist_ok=True)
        for member in members:
            if member.is_dir():
                continue
            target = folder.joinpath(*PurePosixPath(member.filename).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source:
                payload = source.read(MAX_UNPACKED_BYTES + 1)
            if len(payload) != member.file_size:  # a header that lies about its size
                raise BundleError(f"the app bundle's {member.filename} is not the size it says")
            target.write_bytes(payload)
    return folder


def missing_dependencies(folder: Path) -> list[str]:
    """The unpacked app's `[project] dependencies` that are not installed here in a matching version."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    project = tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))
    missing = []
    for entry in project.get("project", {}).get("dependencies", []):
        try:
            requirement = Requirement(entry)
        except InvalidRequirement:
            missing.append(f"{entry} (not a requirement)")
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            missing.append(f"{entry} (not installed)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            missing.append(f"{entry} ({installed} installed)")
    return missing


@contextmanager
def importable(folder: Path, *references: str) -> Iterator[None]:
    """The unpacked app's modules importable (first on the path) while it is loaded and run; the packages the
    `references` (module:attribute) name that the bundle holds are imported afresh, not taken from an earlier
    run's bundle (a package it does not hold, hydrafl's own say, is left as it is)."""
    named = {reference.partition(":")[0].split(".")[0] for reference in references}
    packages = {
        name for name in named if (folder / name).is_dir() or (folder / f"{name}.py").is_file()
    }
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
