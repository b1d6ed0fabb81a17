"""Per-site bounds on what one site can make the coordinator do: concurrent calls, idle streams, failed
logins, and bytes uploaded that no reply references yet. One site's misbehaviour stays that site's problem:
the health check and the other sites keep their threads, disk and bandwidth."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteLimits:
    max_calls: int = 8
    """Calls one site may have in flight at once (unary and streaming)."""
    max_streams: int = 4
    """Of those, chunk streams (uploads and downloads): each holds a handler thread while it lasts."""
    stream_idle_s: float = 30.0
    """A chunk stream that moves no chunk for this long is cancelled."""
    max_model_bytes: int = 16 << 30
    """Arrays a reply may carry when the message it answers carried none (the initial model)."""
    max_auth_failures: int = 10
    """Failed logins per client address within `auth_window_s`; beyond them the address is refused outright,
    unless the token it presents is a site's (guessers behind a site's NAT or proxy never lock the site out)."""
    auth_window_s: float = 60.0
    known_tokens_refresh_s: float = 1.0
    """How often, at most, the enrolled sites' token hashes are read again for a token not yet known: a site
    enrolled while its address is throttled gets in within this long, and guesses cost one read per period."""
    handler_threads: int = 64
    max_connections: int = 512
    """gRPC connections open at once, from sites and anyone else; one more is closed as soon as it is accepted
    (gRPC's `max_allowed_incoming_connections`), so idle peers cannot use up the coordinator's descriptors."""
    handshake_timeout_s: float = 10.0
    """A connection that has not finished its TLS and HTTP/2 handshake this long after it was accepted is closed."""


class LimitExceeded(Exception):
    """A per-site bound was reached; the call gets RESOURCE_EXHAUSTED with this reason."""


class _Stream:
    __slots__ = ("context", "last_active")

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.last_active = time.monotonic()

    def touch(self) -> None:
        self.last_active = time.monotonic()


class CallGuard:
    """Counts each site's calls in flight and cancels chunk streams that stay idle (a watchdog thread: a
    synchronous gRPC handler blocked on a silent client cannot time itself out)."""

    def __init__(self, limits: SiteLimits) -> None:
        self.limits = limits
        self._calls: dict[int, int] = defaultdict(int)
        self._streams: dict[int, set[_Stream]] = defaultdict(set)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="stream-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    @contextmanager
    def call(self, node_id: int) -> Iterator[None]:
        with self._lock:
            if self._calls[node_id] >= self.limits.max_calls:
                raise LimitExceeded(
                    f"this site already has {self.limits.max_calls} calls in flight"
                )
            self._calls[node_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls[node_id] -= 1

    @contextmanager
    def stream(self, node_id: int, context: grpc.ServicerContext) -> Iterator[_Stream]:
        """A chunk stream of this site; the caller touches it for every chunk that moves."""
        stream = _Stream(context)
        with self.call(node_id):
            with self._lock:
                if len(self._streams[node_id]) >= self.limits.max_streams:
                    raise LimitExceeded(
                        f"this site already has {self.limits.max_streams} chunk streams open"
                    )
                self._streams[node_id].add(stream)
            try:
                yield stream
            finally:
                with self._lock:
                    self._streams[node_id].discard(stream)

    def _watch(self) -> None:
        period = min(1.0, self.limits.stream_idle_s / 4)
        while not self._stop.wait(period):
            horizon = time.monotonic() - self.limits.stream_idle_s
            with self._lock:
                idle = [
                    s
                    for streams in self._streams.values()
                    for s in streams
                    if s.last_active < horizon
                ]
            for stream in idle:
                stream.context.cancel()


class AuthThrottle:
    """Failed logins per client address in a sliding window; an address over the limit is refused before its
    token is looked up in the database, so guessing tokens costs the coordinator (and its audit log) a bounded
    amount. A token whose hash is a site's (`known`, in memory) passes whatever its address did."""

    def __init__(self, limits: SiteLimits, token_hashes: Callable[[], Collection[str]]) -> None:
        self.limits = limits
        self._failures: dict[str, deque[float]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._token_hashes = token_hashes
        self._known: frozenset[str] = frozenset()
        self._known_at = -math.inf
        self._reload_lock = threading.Lock()

    def known(self, digest: str) -> bool:
        """Whether `digest` is an enrolled, unrevoked site's token hash, as of at most `known_tokens_refresh_s`
        ago; an unknown one reloads the hashes at most once per that period, whoever asks."""
        if digest in self._known:
            return True
        with self._reload_lock:
            if time.monotonic() - self._known_at >= self.limits.known_tokens_refresh_s:
                self._known = frozenset(self._token_hashes())
                self._known_at = time.monotonic()
        return digest in self._known

    def _recent(self, peer: str, now: float) -> deque[float]:
        failures = self._failures[peer]
        while failures and failures[0] < now - self.limits.auth_window_s:
            failures.popleft()
        return failures

    def blocked_for(self, peer: str) -> float:
        """Seconds until `peer` may try again; 0 when it may now."""
        now = time.monotonic()
        with self._lock:
            failures = self._recent(peer, now)
            if len(failures) < self.limits.max_auth_failures:
                return 0.0
            return failures[0] + self.limits.auth_window_s - now

    def failed(self, peer: str) -> int:
        """Record a failure; returns the failures in the window, this one included."""
        now = time.monotonic()
        with self._lock:
            failures = self._recent(peer, now)
            failures.append(now)
            if len(self._failures) > 10_000:  # forget addresses with no recent failure
                for stale in [
                    p
                    for p, f in self._failures.items()
                    if not f or f[-1] < now - self.limits.auth_window_s
                ]:
                    del self._failures[stale]
            return len(failures)


@dataclass(frozen=True, slots=True)
class UploadQuota:
    """What the messages a site may answer allow to wait for its reply: bytes, and chunks (each stored chunk takes
    a whole pack slot on disk, however few bytes it holds)."""

    nbytes: int
    chunks: int


@dataclass(slots=True)
class _Pending:
    sizes: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0


class UploadLedger:
    """Per site: the chunks it uploaded that no accepted reply references yet, and their bytes. The quota is
    what the site's open messages allow it to answer with; chunks are freed when a push fails or the site has
    nothing left to answer."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = defaultdict(_Pending)
        self._lock = threading.Lock()

    def reserve(self, node_id: int, digest: str, nbytes: int, quota: UploadQuota) -> None:
        with self._lock:
            pending = self._pending[node_id]
            if digest in pending.sizes:
                return
            if pending.nbytes + nbytes > quota.nbytes:
                raise LimitExceeded(
                    f"upload quota exceeded: {pending.nbytes + nbytes} bytes would wait for a reply, and the "
                    f"messages this site may answer allow {quota.nbytes}"
                )
            if len(pending.sizes) + 1 > quota.chunks:
                raise LimitExceeded(
                    f"upload quota exceeded: {len(pending.sizes) + 1} chunks would wait for a reply, and the "
                    f"messages this site may answer allow {quota.chunks}"
                )
            pending.sizes[digest] = nbytes
            pending.nbytes += nbytes

    def referenced(self, node_id: int, digests: set[str]) -> None:
        with self._lock:
            pending = self._pending[node_id]
            for digest in digests & pending.sizes.keys():
                pending.nbytes -= pending.sizes.pop(digest)

    def release(self, node_id: int) -> list[str]:
        """Forget the site's unreferenced chunks; the caller deletes them."""
        with self._lock:
            return list(self._pending.pop(node_id, _Pending()).sizes)

    def pending_bytes(self, node_id: int) -> int:
        with self._lock:
            return self._pending[node_id].nbytes
