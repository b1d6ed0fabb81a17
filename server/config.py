"""Everything a coordinator process is told: where it listens, its database, its folders, TLS, lease, limits.

Built once, from `hydrafl server`'s flags and an optional TOML file with the same names as keys, validated
then, and handed to `Coordinator` whole. Torch-free, like every type the command line reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydrafl.configfile import load_toml
from hydrafl.netaddr import check_address
from hydrafl.server.paths import data_dir, default_blob_dir, default_db_url
from hydrafl.server.transport.limits import SiteLimits
from hydrafl.server.transport.tls import ServerTls
from hydrafl.tracking import TrackTarget
from hydrafl.validation import ConfigError

DEFAULT_LISTEN = "127.0.0.1:9091"
LEASE_STALE_S = 30.0
"""A coordinator whose lease went unrenewed this long is presumed dead; it renews every sixth of it."""
DEFAULT_KEEP_CHECKPOINTS = 2
"""Each run keeps its last this many rounds' checkpoints (the newest is the model a finished run ends with)."""
DEFAULT_SEND_CACHE_MB = 2048
"""Memory for the model a round sends, in its wire form (`server.sent_cache`; 0 turns it off)."""
DEFAULT_RESIDENT_MODEL_MB = 1024
"""A global model larger than this stays on disk and is aggregated tensor by tensor (`strategies.by_tensor`)."""
OPTION_KEYS = (
    "listen",
    "db",
    "blobs",
    "tls-cert",
    "tls-key",
    "tls-client-ca",
    "lease-stale-s",
    "keep-checkpoints",
    "send-cache-mb",
    "resident-model-mb",
    "track",
)
NUMBER_KEYS = ("lease-stale-s", "keep-checkpoints", "send-cache-mb", "resident-model-mb")
"""`hydrafl server`'s options without their dashes: the keys of its TOML file."""
TLS_KEYS = ("tls-cert", "tls-key", "tls-client-ca")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """One coordinator process. Defaults put its state under $HYDRAFL_HOME (`server.paths`)."""

    listen: str = DEFAULT_LISTEN
    """HOST:PORT (or a gRPC target such as unix:PATH) to serve sites on."""
    db_url: str = field(default_factory=default_db_url)
    """SQLAlchemy URL of the database of sites, runs and the coordinator lease."""
    home: Path = field(default_factory=data_dir)
    """The folder the default database, blobs and run folders live in; created at start."""
    blob_dir: Path = field(default_factory=default_blob_dir)
    """Where array chunks are kept, content-addressed."""
    runs_dir: Path = field(default_factory=lambda: data_dir() / "runs")
    """One folder per run: its checkpoints and logs."""
    tls: ServerTls | None = None
    """None serves in clear text (warned about off loopback)."""
    limits: SiteLimits = SiteLimits()
    """Per-site bounds on what one site can make the coordinator do."""
    lease_stale_s: float = LEASE_STALE_S
    """Seconds without a heartbeat after which another coordinator may take this one's lease over."""
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    """Checkpoints kept per run (`server.retention`); older rounds' checkpoints, messages and chunks are deleted."""
    send_cache_mb: int = DEFAULT_SEND_CACHE_MB
    """MiB of the chunks sent last kept in memory for the sites' downloads (`server.sent_cache`); 0: none."""
    resident_model_mb: int = DEFAULT_RESIDENT_MODEL_MB
    """MiB: a global model larger than this stays in the run folder and rounds aggregate it tensor by tensor,
    so the coordinator's memory does not grow with the model; replies larger stay in the blob store."""
    track: str = ""
    """tensorboard:DIR or mlflow:URI: every run this coordinator drives is followed there (`hydrafl.tracking`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.listen, str) or not self.listen.strip():
            raise ConfigError(f"listen must be HOST:PORT, got {self.listen!r}")
        check_address("--listen", self.listen)
        if not isinstance(self.db_url, str) or not self.db_url:
            raise ConfigError(f"db must be a SQLAlchemy URL, got {self.db_url!r}")
        stale_s = self.lease_stale_s
        number = isinstance(stale_s, int | float) and not isinstance(stale_s, bool)
        if not (number and math.isfinite(stale_s) and stale_s > 0):
            raise ConfigError(
                f"lease-stale-s must be a positive number of seconds, got {stale_s!r}"
            )
        keep = self.keep_checkpoints
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(
                f"keep-checkpoints must be a whole number of at least 1, got {keep!r}"
            )
        if self.track:
            TrackTarget.parse(self.track)
        for key, mib in (
            ("send-cache-mb", self.send_cache_mb),
            ("resident-model-mb", self.resident_model_mb),
        ):
            if not isinstance(mib, int) or isinstance(mib, bool) or mib < 0:
                raise ConfigError(f"{key} must be a whole number of MiB, 0 or more, got {mib!r}")

    @classmethod
    def from_options(
        cls, values: Mapping[str, Any], *, source: str = "options"
    ) -> CoordinatorConfig:
        """From `hydrafl server`'s options by name (`OPTION_KEYS`); an unknown key or a value of the wrong type
        is a ConfigError that names it and `source`."""
        unknown = sorted(set(values) - set(OPTION_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown key {unknown[0]!r} in {source}; valid keys: {', '.join(sorted(OPTION_KEYS))}"
            )
        for key, value in values.items():
            if key not in NUMBER_KEYS and not isinstance(value, str | Path):
                raise ConfigError(f"key {key!r} in {source} must be a string, got {value!r}")
        cert, tls_key, client_ca = (
            Path(values[name]) if values.get(name) else None for name in TLS_KEYS
        )
        given: dict[str, Any] = {
            "tls": ServerTls.from_options(cert, tls_key, client_ca),
            "listen": str(values.get("listen", DEFAULT_LISTEN)),
            "lease_stale_s": values.get("lease-stale-s", LEASE_STALE_S),
            "keep_checkpoints": values.get("keep-checkpoints", DEFAULT_KEEP_CHECKPOINTS),
            "send_cache_mb": values.get("send-cache-mb", DEFAULT_SEND_CACHE_MB),
            "resident_model_mb": values.get("resident-model-mb", DEFAULT_RESIDENT_MODEL_MB),
            "track": str(values.get("track", "")),
        }
        if values.get("db"):
            given["db_url"] = str(values["db"])
        if values.get("blobs"):
            given["blob_dir"] = Path(values["blobs"])
        return cls(**given)

    @classmethod
    def load(cls, path: Path | None, flags: Mapping[str, Any]) -> CoordinatorConfig:
        """The TOML file at `path` (if any) overridden by the `flags` given on the command line."""
        values = {**(load_toml(path) if path else {}), **flags}
        return cls.from_options(values, source=str(path) if path else "options")

    @property
    def transport(self) -> str:
        """How sites connect: no TLS, TLS or mutual TLS."""
        return "no TLS" if self.tls is None else self.tls.mode
