"""`hydrafl server --dashboard`: a read-only web page and Prometheus `/metrics`, served next to the coordinator.

Standard library only (`http.server`), in the coordinator process, reading the same database. The listener is
bounded so that no client, with or without the token, reaches the coordinator's threads or descriptors: at most
`max_connections` open at once (one more is closed as soon as it is accepted), a connection waits for its first
bytes without a thread (one selector thread), `workers` threads answer requests, and a connection is closed
`request_timeout_s` after it was accepted whatever it is doing (idle, sending slowly, or reading slowly).
Every request needs the admin token: `Authorization: Bearer <token>` (Prometheus, curl) or, for a browser,
`?token=<token>` once, which is answered by a redirect that drops it from the address bar and sets an HttpOnly
cookie the browser sends from then on. Paths: `/` (the page, with the running or newest run), `/runs/<id>` (the
page with that run), `/metrics` (Prometheus text). GET and HEAD only: nothing here changes state.
"""

from __future__ import annotations

import errno
import hmac
import logging
import math
import queue
import re
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hydrafl.netaddr import is_loopback
from hydrafl.server.dashboard_page import render_page
from hydrafl.server.metrics import metrics_text
from hydrafl.server.store import Store
from hydrafl.server.transport.service import CoordinatorService
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
    max_connections: int = 64
    """Connections open at once; one more is closed as soon as it is accepted (the dashboard never holds more
    than this many of the coordinator's descriptors)."""
    workers: int = 4
    """Threads that answer requests; a connection gets one once its first bytes arrive."""
    request_timeout_s: float = 10.0
    """Seconds from accepting a connection to closing it, whether or not its request was read and answered."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"dashboard {name.replace('_', '-')} must be a whole number of at least 1, got {value!r}"
                )
        timeout_s = self.request_timeout_s
        if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ConfigError(
                f"dashboard request-timeout-s must be a positive number of seconds, got {timeout_s!r}"
            )
        if not self.token:
            raise ConfigError(
                f"--dashboard needs an admin token: pass --dashboard-token or set {TOKEN_ENV}"
            )
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
    coordinator starts); `start` serves on daemon threads, `stop` shuts it down."""

    def __init__(
        self,
        config: DashboardConfig,
        store: Store,
        runs_dir: Path,
        service: CoordinatorService | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.runs_dir = runs_dir
        self.service = service
        try:
            self.server = _BoundedServer(config, self)
        except OSError as error:
            raise OSError(
                f"cannot serve the dashboard on {config.listen}: {error.strerror or error}"
            ) from error

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def open_connections(self) -> int:
        """Connections accepted and not yet closed (waiting for bytes or being answered)."""
        return self.server.open_connections()

    def authorized(self, token: str) -> bool:
        """Constant-time comparison, so response times do not reveal how much of a guess was right."""
        return bool(token) and hmac.compare_digest(token.encode(), self.config.token.encode())


REFUSED_LOG_EVERY_S = 60.0
"""Connections refused over the cap are logged once per this period, with their count, not one line each."""
ACCEPT_BACKOFF_S = 0.1
"""After an accept failed for want of descriptors: the listener waits this long rather than spin."""


class _BoundedServer(HTTPServer):
    """An HTTPServer with a connection cap, a fixed pool of worker threads and a deadline per connection.

    One selector thread accepts (closing a connection over the cap at once), waits for each connection's first
    bytes, and hands it to a worker; it also enforces the deadline: a connection still waiting is closed, one
    a worker holds is shut down, which ends the worker's blocked read or write. Workers close what they answer."""

    request_queue_size = (
        128  # a deep accept queue, drained promptly: surplus connections are closed, not left
    )

    def __init__(self, config: DashboardConfig, dashboard: Dashboard) -> None:
        host, port = config.address
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self.config = config
        self.dashboard = dashboard
        self.socket.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, float] = {}
        """Accepted, no bytes yet -> its deadline (selector thread only)."""
        self._busy: dict[socket.socket, float] = {}
        """Queued for or held by a worker -> its deadline."""
        self._lock = threading.Lock()
        self._ready: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._refused = 0
        self._refused_logged_at = -math.inf
        self._threads = [
            threading.Thread(target=self._select_loop, name="dashboard", daemon=True)
        ] + [
            threading.Thread(target=self._work, name=f"dashboard-worker-{i}", daemon=True)
            for i in range(config.workers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for _ in range(self.config.workers):
            self._ready.put(None)
        if self._threads[0].is_alive():
            self._threads[0].join()
        for conn in list(self._waiting):
            conn.close()
        self._waiting.clear()
        with self._lock:
            for conn in self._busy:
                _shut(conn)
        self.server_close()

    def open_connections(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._busy)

    # --- the selector thread --------------------------------------------------------------------------------

    def _select_loop(self) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(timeout=0.25):
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._dispatch(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            self._selector.close()

    def _accept(self) -> None:
        """Take every connection waiting in the kernel: keep those under the cap, close the rest at once."""
        while True:
            try:
                conn, _ = self.socket.accept()
            except BlockingIOError:
                return
            except (
                OSError
            ) as error:  # out of descriptors (the coordinator's or the system's), or a reset
                if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning(
                        "dashboard: cannot accept connections (%s); retrying",
                        error.strerror or error,
                    )
                    self._stopping.wait(ACCEPT_BACKOFF_S)
                return
            if self.open_connections() >= self.config.max_connections:
                conn.close()
                self._refused_one()
                continue
            deadline = time.monotonic() + self.config.request_timeout_s
            conn.setblocking(False)
            with self._lock:
                self._waiting[conn] = deadline
            self._selector.register(conn, selectors.EVENT_READ)

    def _refused_one(self) -> None:
        self._refused += 1
        now_s = time.monotonic()
        if now_s - self._refused_logged_at >= REFUSED_LOG_EVERY_S:
            log.warning(
                "dashboard: %d connection(s) closed unanswered: %d are open, the most it holds",
                self._refused,
                self.config.max_connections,
            )
            self._refused, self._refused_logged_at = 0, now_s

    def _dispatch(self, conn: socket.socket) -> None:
        """Its first bytes arrived: a worker answers it."""
        self._selector.unregister(conn)
        with self._lock:
            self._busy[conn] = self._waiting.pop(conn)
        self._ready.put(conn)

    def _expire(self, now_s: float) -> None:
        with self._lock:
            idle = [conn for conn, deadline in self._waiting.items() if deadline <= now_s]
            for conn in idle:
                del self._waiting[conn]
            for conn, deadline in self._busy.items():
                if deadline <= now_s:  # under the lock: its worker has not closed it yet
                    _shut(conn)  # the worker's read or write returns, and it closes the connection
        for conn in idle:
            self._selector.unregister(conn)
            conn.close()

    # --- the workers ----------------------------------------------------------------------------------------

    def _work(self) -> None:
        while (conn := self._ready.get()) is not None:
            with self._lock:
                deadline = self._busy.get(conn, 0.0)
            try:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                self.finish_request(conn, conn.getpeername())
            except Exception as error:  # a dropped or reset connection ends its request only
                log.debug("dashboard: a connection ended early: %s", error)
            finally:
                with self._lock:
                    self._busy.pop(conn, None)
                _shut(conn)
                conn.close()


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer
        pass


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
        except Exception:
            log.exception("dashboard: %s failed", url.path)
            self._send(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                b"internal error; the coordinator log has the reason\n",
            )

    def _route(self, path: str) -> None:
        if path == "/metrics":
            body = metrics_text(self.dashboard.store, self.dashboard.service)
            self._send(HTTPStatus.OK, body, CONTENT_TYPE_LATEST)
            return
        run_path = RUN_PATH.fullmatch(path)
        if path not in ("/", "/index.html") and run_path is None:
            self._send(
                HTTPStatus.NOT_FOUND,
                b"not found; the dashboard serves /, /runs/<id> and /metrics\n",
            )
            return
        run_id = int(run_path.group(1)) if run_path else None
        try:
            page = render_page(
                self.dashboard.store, self.dashboard.runs_dir, self.dashboard.service, run_id
            )
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
        self._send(
            HTTPStatus.UNAUTHORIZED, body, headers={"WWW-Authenticate": 'Bearer realm="hydrafl"'}
        )

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in {
            **SECURITY_HEADERS,
            "Content-Type": content_type,
            **(headers or {}),
        }.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Requests go to the debug log without their query string: it may hold the token."""
        log.debug(
            "dashboard %s %s -> %s", self.command, urlsplit(getattr(self, "path", "")).path, code
        )

    def log_message(self, format: str, *args: object) -> None:
        """Errors of requests that did not parse; the request line is left out for the same reason."""
        log.debug("dashboard: malformed request from %s", self.client_address[0])
