"""`hydrafl server --dashboard`: a read-only web page and Prometheus `/metrics`, served next to the coordinator.

Standard library only (`http.server`), on a daemon thread of the coordinator process, reading the same database.
Every request needs the admin token: `Authorization: Bearer <token>` (Prometheus, curl) or, for a browser,
`?token=<token>` once, which is answered by a redirect that drops it from the address bar and sets an HttpOnly
cookie the browser sends from then on. Paths: `/` (the page, with the running or newest run), `/runs/<id>` (the
page with that run), `/metrics` (Prometheus text). GET and HEAD only: nothing here changes state.
"""

from __future__ import annotations

import hmac
import logging
import re
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hydrafl.netaddr import is_loopback
from hydrafl.server.dashboard_page import render_page
from hydrafl.server.metrics import metrics_text
from hydrafl.server.service import CoordinatorService
from hydrafl.server.store import Store
from hydrafl.validation import ConfigError

log = logging.getLogger(__name__)

TOKEN_ENV = "HYDRAFL_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16
"""An admin token shorter than this is refused: it guards every site's and run's records."""
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]+")
"""URL- and cookie-safe characters (what `secrets.token_urlsafe` and base64 produce)."""
COOKIE = "hydrafl_dashboard"
RUN_PATH = re.compile(r"/runs/(\d{1,9})")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
"""The page runs no script and loads nothing; the token never leaves in a Referer and no proxy caches a page."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DashboardConfig:
    """Where the dashboard listens and the admin token it asks of every request."""

    listen: str
    """HOST:PORT, or a bare PORT (then 127.0.0.1); port 0 takes a free one."""
    token: str = ""

    def __post_init__(self) -> None:
        if not self.token:
            raise ConfigError(f"--dashboard needs an admin token: pass --dashboard-token or set {TOKEN_ENV}")
        if len(self.token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"the dashboard token has {len(self.token)} characters; use at least {MIN_TOKEN_CHARS} "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        if not TOKEN_CHARS.fullmatch(self.token):
            raise ConfigError("the dashboard token may hold only letters, digits and . _ ~ + / = -")
        host, port = self.address
        if not host or not 0 <= port < 65536:
            raise ConfigError(f"--dashboard must be HOST:PORT or PORT, got {self.listen!r}")

    @property
    def address(self) -> tuple[str, int]:
        """(host, port); a bare port binds loopback only."""
        text = self.listen.strip()
        host, _, port = text.rpartition(":") if ":" in text else ("127.0.0.1", "", text)
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        return host, int(port) if port.isdigit() else -1

    @property
    def plaintext_warning(self) -> str | None:
        """Why serving on `listen` is unsafe, or None: the dashboard speaks HTTP, private only on loopback."""
        host, port = self.address
        if is_loopback(f"[{host}]:{port}" if ":" in host else f"{host}:{port}"):
            return None
        return (
            f"dashboard on {self.listen} WITHOUT TLS: the admin token and every run's records cross the network "
            "in clear text; bind it to 127.0.0.1 behind a TLS-terminating proxy"
        )


class Dashboard:
    """The dashboard's HTTP server. The constructor binds the port (a port in use is an OSError before the
    coordinator starts); `start` serves on a daemon thread, `stop` shuts it down."""

    def __init__(
        self, config: DashboardConfig, store: Store, runs_dir: Path, service: CoordinatorService | None = None
    ) -> None:
        self.config = config
        self.store = store
        self.runs_dir = runs_dir
        self.service = service
        host, port = config.address
        server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
        try:
            self.server = server_class((host, port), _Handler)
        except OSError as error:
            raise OSError(f"cannot serve the dashboard on {config.listen}: {error.strerror or error}") from error
        self.server.daemon_threads = True
        self.server.dashboard = self  # type: ignore[attr-defined]  (read by the handler)
        self._thread = threading.Thread(target=self.server.serve_forever, name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def authorized(self, token: str) -> bool:
        """Constant-time comparison, so response times do not reveal how much of a guess was right."""
        return bool(token) and hmac.compare_digest(token.encode(), self.config.token.encode())


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server_version = "hydrafl-dashboard"
    sys_version = ""

    @property
    def dashboard(self) -> Dashboard:
        return self.server.dashboard  # type: ignore[attr-defined]

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qsl(url.query, keep_blank_values=True)
        given = next((value for key, value in query if key == "token"), None)
        if given is not None:
            self._token_in_query(given, url.path, [(k, v) for k, v in query if k != "token"])
            return
        if not self._credentials_valid():
            self._unauthorized()
            return
        try:
            self._route(url.path)
        except Exception:  # noqa: BLE001  (one failed page must not stop the dashboard; the log has why)
            log.exception("dashboard: %s failed", url.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error; the coordinator log has the reason\n")

    def _route(self, path: str) -> None:
        if path == "/metrics":
            body = metrics_text(self.dashboard.store, self.dashboard.service)
            self._send(HTTPStatus.OK, body, CONTENT_TYPE_LATEST)
            return
        run_path = RUN_PATH.fullmatch(path)
        if path not in ("/", "/index.html") and run_path is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found; the dashboard serves /, /runs/<id> and /metrics\n")
            return
        run_id = int(run_path.group(1)) if run_path else None
        try:
            page = render_page(self.dashboard.store, self.dashboard.runs_dir, self.dashboard.service, run_id)
        except ValueError as error:  # no such run
            self._send(HTTPStatus.NOT_FOUND, f"{error}\n".encode())
            return
        self._send(HTTPStatus.OK, page.encode(), "text/html; charset=utf-8")

    def _credentials_valid(self) -> bool:
        header = self.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return self.dashboard.authorized(header[7:].strip())
        try:
            cookie = SimpleCookie(self.headers.get("Cookie", ""))
        except CookieError:
            return False
        return COOKIE in cookie and self.dashboard.authorized(cookie[COOKIE].value)

    def _token_in_query(self, token: str, path: str, rest: list[tuple[str, str]]) -> None:
        """A browser's first visit: keep the token in a cookie and redirect to the URL without it."""
        if not self.dashboard.authorized(token):
            self._unauthorized()
            return
        location = path + (f"?{urlencode(rest)}" if rest else "")
        cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax"
        self._send(HTTPStatus.SEE_OTHER, b"", headers={"Location": location, "Set-Cookie": cookie})

    def _unauthorized(self) -> None:
        body = (
            b"401 Unauthorized: the dashboard needs its admin token. Open /?token=<token> in a browser, or send "
            b"'Authorization: Bearer <token>'.\n"
        )
        self._send(HTTPStatus.UNAUTHORIZED, body, headers={"WWW-Authenticate": 'Bearer realm="hydrafl"'})

    def _send(
        self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in {**SECURITY_HEADERS, "Content-Type": content_type, **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Requests go to the debug log without their query string: it may hold the token."""
        log.debug("dashboard %s %s -> %s", self.command, urlsplit(getattr(self, "path", "")).path, code)

    def log_message(self, format: str, *args: object) -> None:
        """Errors of requests that did not parse; the request line is left out for the same reason."""
        log.debug("dashboard: malformed request from %s", self.client_address[0])
