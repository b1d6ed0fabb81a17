"""Drives the two state machines through one round in memory, with sites that can drop at a chosen stage."""

from __future__ import annotations

import numpy as np

from hydrafl.secagg import (
    SecAggParams,
    ServerSession,
    SiteIdentity,
    SiteSession,
    decode_sum,
    encode,
)
from hydrafl.secagg.identity import new_signing_key


def updates(nodes: list[int], length: int, seed: int = 0) -> dict[int, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return {node: (rng.normal(0.0, 0.05, length), int(rng.integers(20, 500))) for node in nodes}


def identities(nodes: list[int], consortium: bytes | None = None) -> dict[int, SiteIdentity]:
    """Each node's identity, certified by one consortium key (a new one unless given)."""
    consortium = consortium or new_signing_key()
    return {node: SiteIdentity.issue(consortium, node) for node in nodes}


def sessions(
    nodes: list[int], params: SecAggParams, server_round: int = 1
) -> dict[int, SiteSession]:
    ids = identities(nodes)
    return {node: SiteSession.start(node, server_round, nodes, params, ids[node]) for node in nodes}


def started(
    nodes: list[int], params: SecAggParams, length: int
) -> tuple[ServerSession, dict[int, SiteSession]]:
    """A round through the share-keys stage: every site sent keys and shares."""
    sites = sessions(nodes, params)
    server = ServerSession.start(1, nodes, params, length)
    for node, site in sites.items():
        server.receive_keys(node, site.public_keys())
    for node, site in sites.items():
        server.receive_shares(node, site.share_keys(server.keys_for(node)))
    return server, sites


def masked(
    data: dict[int, tuple[np.ndarray, int]],
    params: SecAggParams,
    *,
    drop_before_upload: tuple[int, ...] = (),
    seen: dict[int, np.ndarray] | None = None,
) -> tuple[ServerSession, dict[int, SiteSession]]:
    """A round through the masked-vector stage; `seen` collects each masked vector the coordinator got."""
    nodes = sorted(data)
    server, sites = started(nodes, params, next(iter(data.values()))[0].size + 1)
    rng = np.random.default_rng(1)
    for node in nodes:
        if node in drop_before_upload:
            continue
        delta, weight = data[node]
        vector = sites[node].mask(encode(delta, weight, params, rng), server.shares_for(node))
        if seen is not None:
            seen[node] = vector
        server.receive_masked(node, vector)
    return server, sites


def checked(
    server: ServerSession, sites: dict[int, SiteSession], silent: tuple[int, ...] = ()
) -> None:
    """The consistency check: every survivor but the `silent` signs the survivor set."""
    survivors = server.check_request()
    for node in survivors:
        if node not in silent:
            server.receive_signature(node, sites[node].sign_survivors(survivors))


def secure_sum(
    data: dict[int, tuple[np.ndarray, int]],
    params: SecAggParams,
    *,
    drop_before_upload: tuple[int, ...] = (),
    silent_in_unmask: tuple[int, ...] = (),
    seen: dict[int, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(weight sum, weighted delta sum) the coordinator learns."""
    server, sites = masked(data, params, drop_before_upload=drop_before_upload, seen=seen)
    checked(server, sites)
    survivors, signatures = server.unmask_request()
    for node in signatures:
        if node not in silent_in_unmask:
            server.receive_unmask(node, sites[node].unmask(survivors, signatures))
    total, count = server.result()
    return decode_sum(total, count, params, per_coordinate=False)
