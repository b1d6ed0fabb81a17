"""Plain-HTTP requests to the dashboard as a script or a browser's first request makes them: no redirects
followed, so a test sees the 303 and the cookie it sets."""

from __future__ import annotations

import urllib.error
import urllib.request


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """(status, headers, body); 3xx and 4xx are answers here, not exceptions."""
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(
            urllib.request.Request(url, headers=headers or {}), timeout=10
        ) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()
