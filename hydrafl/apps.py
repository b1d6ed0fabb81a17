"""The Flower ServerApp and ClientApp that every hydrafl runtime runs, under one name for users and tools
(`hydrafl site --app hydrafl.apps:client_app`). They live in `server_app` and `site_app` so that the
coordinator imports no model code."""

from hydrafl.server_app import server_app
from hydrafl.site_app import client_app

__all__ = ["client_app", "server_app"]
