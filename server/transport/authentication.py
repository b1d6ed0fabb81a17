"""Who is calling: a site's bearer token (and, with mutual TLS, its client certificate) names the site, and
nothing else it sends is trusted for who it is; an administrator's token (`TokenGate` over the admin tokens)
names the administrator. Failed logins are throttled per client address and audited;
each authenticated call marks when the site was last seen."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import NoReturn, cast

import grpc

from hydrafl.bounded import bounded
from hydrafl.server.store import Store, hash_token
from hydrafl.server.tables import Site
from hydrafl.server.transport import limits as bounds

log = logging.getLogger(__name__)


class TokenGate:
    """Bearer tokens of one kind of caller (sites, or administrators): failed logins throttled per client
    address and audited, and a token whose hash `known_hashes` lists never throttled (guessers behind a caller's
    NAT or proxy never lock it out)."""

    def __init__(
        self, store: Store, limits: bounds.SiteLimits, known_hashes: Callable[[], Collection[str]]
    ) -> None:
        self.store = store
        self.limits = limits
        self.throttle = bounds.AuthThrottle(limits, known_hashes)

    def token(self, context: grpc.ServicerContext) -> str:
        """The call's bearer token; aborts when the caller's address is throttled or it presents none."""
        metadata = context.invocation_metadata()
        headers = [str(value) for key, value in metadata if key == "authorization"]  # not `-bin`
        token = (
            headers[0][7:].strip() if len(headers) == 1 and headers[0].startswith("Bearer ") else ""
        )
        if not (token and self.throttle.known(hash_token(token))):
            wait_s = self.throttle.blocked_for(peer_address(context))
            if wait_s:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many failed authentications from this address; try again in {wait_s:.0f} s",
                )
        if not token:
            self.failed(context, "no 'authorization: Bearer <token>' header")
        return token

    def failed(self, context: grpc.ServicerContext, reason: str) -> NoReturn:
        peer = peer_address(context)
        reason = bounded(reason)  # it may quote the names on a peer's certificate
        failures = self.throttle.failed(peer)
        if (
            failures <= self.limits.max_auth_failures
        ):  # beyond it the address is refused without a record each time
            log.warning("authentication failed from %s: %s", peer, reason)
            kind = "auth-failed" if failures < self.limits.max_auth_failures else "auth-throttled"
            self.store.audit(kind, detail=f"{peer}: {reason}")
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)


class SiteAuthenticator:
    """The site making each call, or an abort with UNAUTHENTICATED (RESOURCE_EXHAUSTED for a throttled
    address)."""

    def __init__(self, store: Store, limits: bounds.SiteLimits) -> None:
        self.store = store
        self.gate = TokenGate(store, limits, store.token_hashes)
        self._lock = threading.Lock()
        self.last_seen: dict[int, float] = {}
        """Node id -> when (monotonic) the site last made an authenticated call to this process."""

    def connected_nodes(self, within_s: float = 30.0) -> list[int]:
        """Sites that called in recently and are still enrolled."""
        horizon = time.monotonic() - within_s
        active = {site.node_id for site in self.store.sites() if not site.revoked}
        with self._lock:
            return sorted(
                node for node, seen in self.last_seen.items() if seen >= horizon and node in active
            )

    def seconds_since_seen(self) -> dict[int, float]:
        """Node id -> seconds since the site's last authenticated call to this process (the dashboard's "last
        call"; the database keeps no record of polls)."""
        now_s = time.monotonic()
        with self._lock:
            return {node: now_s - seen for node, seen in self.last_seen.items()}

    def site(self, context: grpc.ServicerContext) -> Site:
        site = self.store.authenticate(self.gate.token(context))
        if site is None:
            self.gate.failed(context, "unknown or revoked site token")
        names = _certificate_names(context)
        if names is not None and site.name not in names:
            self.gate.failed(
                context,
                f"the client certificate ({', '.join(sorted(names))}) was not issued to site {site.name!r}",
            )
        with self._lock:
            self.last_seen[site.node_id] = time.monotonic()
        return site


def peer_address(context: grpc.ServicerContext) -> str:
    """The client's address without its port: 'ipv4:10.0.0.5:51234' -> 'ipv4:10.0.0.5'."""
    peer = context.peer()
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


def _certificate_names(context: grpc.ServicerContext) -> set[str] | None:
    """The names on the client certificate (common name and subject alternative names), None when the client
    presented none (no mutual TLS): with mutual TLS a certificate authenticates only the site it names."""
    # a list of values per property (grpc's stub types each as one bytes value)
    auth = cast(Mapping[str, list[bytes]], context.auth_context())
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    if "x509_pem_cert" not in auth and not names:
        return None
    return {name.decode(errors="replace") for name in names}
