"""Flower app bundles a run ships to this site (`hydrafl.app_bundle`): run only when the site's policy lists the
bundle's SHA-256 (`allowed-apps`, `--allow-app`), unpacked into a folder of the run's own, with its dependencies
checked against what the site has installed (never installed). Anything else is the reason the site gives, as
its reply to every message of that run: the site itself goes on serving."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from flwr.clientapp import ClientApp
from flwr.supercore.object_ref import load_app

from hydrafl.app_bundle import (
    BundleError,
    digest_of,
    importable,
    missing_dependencies,
    read_bundle,
    unpack,
)
from hydrafl.client.site_policy import SitePolicy

log = logging.getLogger(__name__)


class ShippedApps:
    def __init__(self, policy: SitePolicy, folder: Path | None = None) -> None:
        self.policy = policy
        self.folder = folder
        """Where each run's bundle is unpacked (`run-ID-DIGEST`); None: a temporary folder, made when needed."""

    def app_for(self, run_id: int, data: bytes) -> ClientApp | str:
        """The bundle's ClientApp, or why this site will not run it."""
        digest = digest_of(data)
        refusal = self.policy.app_refusal(digest)
        if refusal:
            log.warning("run %d ships app bundle sha256:%s; refused: not allowed", run_id, digest)
            return refusal
        try:
            bundle = read_bundle(data)
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="hydrafl-apps-"))
            unpacked = unpack(data, self.folder / f"run-{run_id}-{digest[:16]}")
            missing = missing_dependencies(unpacked)
            if missing:
                raise BundleError(f"its dependencies are not installed here: {', '.join(missing)}")
            with importable(unpacked, bundle.client_app):
                app = load_app(bundle.client_app, ValueError)
        except (BundleError, ImportError, AttributeError, ValueError, OSError) as error:
            reason = f"app bundle sha256:{digest} cannot run here: {' '.join(str(error).split())}"
            log.warning("run %d: %s", run_id, reason)
            return reason
        if not isinstance(app, ClientApp):
            return f"app bundle sha256:{digest}: {bundle.client_app} is not a flwr ClientApp"
        log.info("run %d: running app bundle sha256:%s (%s)", run_id, digest, bundle.client_app)
        return app
