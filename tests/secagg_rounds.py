"""Drives the two state machines through one round in memory, with sites that can drop at a chosen stage."""

from __future__ import annotations

import numpy as np

from hydrafl.secagg import SecAggParams, ServerSession, SiteSession, decode_sum, encode


def updates(nodes: list[int], length: int, seed: int = 0) -> dict[int, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return {node: (rng.normal(0.0, 0.05, length), int(rng.integers(20, 500))) for node in nodes}


def started(nodes: list[int], params: SecAggParams, length: int) -> tuple[ServerSession, dict[int, SiteSession]]:
    """A round through the share-keys stage: every site sent keys and shares."""
    sites = {node: SiteSession.start(node, 1, nodes, params) for node in nodes}
    server = ServerSession.start(1, nodes, params, length)
    for node, site in sites.items():
        server.receive_keys(node, site.public_keys())
    for node, site in sites.items():
        server.receive_shares(node, site.share_keys(server.keys_for(node)))
    return server, sites


def secure_sum(
    data: dict[int, tuple[np.ndarray, int]], params: SecAggParams, *, drop_before_upload: tuple[int, ...] = (),
    silent_in_unmask: tuple[int, ...] = (), seen: dict[int, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(weight sum, weighted delta sum) the coordinator learns; `seen` collects each masked vector it got."""
    nodes = sorted(data)
    length = next(iter(data.values()))[0].size + 1
    server, sites = started(nodes, params, length)
    rng = np.random.default_rng(1)
    for node in nodes:
        if node in drop_before_upload:
            continue
        delta, weight = data[node]
        masked = sites[node].mask(encode(delta, weight, params, rng), server.shares_for(node))
        if seen is not None:
            seen[node] = masked
        server.receive_masked(node, masked)
    survivors, dropped = server.unmask_request()
    for node in survivors:
        if node not in silent_in_unmask:
            server.receive_unmask(node, sites[node].unmask(survivors, dropped))
    total, count = server.result()
    return decode_sum(total, count, params, per_coordinate=False)
