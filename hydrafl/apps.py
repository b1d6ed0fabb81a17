"""The Flower ServerApp and ClientApp that every hydrafl runtime runs, under one name for users and tools
(`hydrafl site --app hydrafl.apps:client_app`). They live in `server_app` and `site_app` so that the
coordinator imports no model code."""

from hydrafl.client.site_app import client_app
from hydrafl.server.server_app import server_app

__all__ = ["client_app", "server_app"]
