"""The coordinator's half of cross-site deduplication, before round 1: ask every site for the keyed MinHash
signatures of its training records (`query.dedup_signatures`), band them with datasketch's MinHashLSH, keep
the record pairs of two sites whose estimated Jaccard similarity is at least the run's threshold, and tell
each site which of its own rows to drop (`query.dedup_drop`). A site learns only its own drop list.

Near copies link into groups; each group keeps one record: at the site with the fewest training records (then
the lowest node id, then the first row), so the shared patients stop inflating the larger site's weight. The
signatures are keyed by the consortium's secret, which the coordinator never holds (`hydrafl.client.dedup`).
Every site must take part: a run that asked for deduplication fails, naming the site and its reason, when one
declines (no key) or holds a key other than the rest's (its key check differs).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message
from flwr.serverapp import Grid

from hydrafl import protocol
from hydrafl.server.aggregation.exchange import query

log = logging.getLogger(__name__)

NUM_PERM = 256
"""Permutations per signature: the estimate's standard error is sqrt(J (1 - J) / NUM_PERM), 0.025 at J = 0.8."""
CANDIDATE_MARGIN = 0.15
"""LSH bands are tuned this far below the threshold, so a pair just above it is a candidate too; candidates
are then kept by their estimated similarity."""
Record = tuple[int, int]
"""(node id, training row)."""


class DedupError(RuntimeError):
    """The deduplication step cannot run: a site declined or sent what it may not."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteDedup:
    """One site's outcome."""

    records: int
    dropped: int


def deduplicate_sites(
    grid: Grid, threshold: float, num_perm: int = NUM_PERM
) -> dict[int, SiteDedup]:
    """Run the exchange with every connected site; per node id, its records and how many it dropped."""
    nodes = sorted(grid.get_node_ids())
    asked = [
        query(node, protocol.QUERY_DEDUP_SIGNATURES, {protocol.DEDUP_NUM_PERM: num_perm})
        for node in nodes
    ]
    signatures: dict[int, np.ndarray] = {}
    checks: dict[int, str] = {}
    refusals: list[tuple[int, str]] = []
    for reply in grid.send_and_receive(asked):
        node = reply.metadata.src_node_id
        if reply.has_error():
            refusals.append((node, str(reply.error.reason)))
            continue
        signatures[node], checks[node] = _signatures_reply(reply, node, num_perm)
    answered = set(signatures) | {node for node, _ in refusals}
    reasons = [f"site {node}: {reason}" for node, reason in sorted(refusals)]
    reasons += [f"site {node}: no reply" for node in nodes if node not in answered]
    if reasons:
        raise DedupError(f"the dedup step needs every site: {'; '.join(reasons)}")
    _check_keys(checks)
    drops = records_to_drop(signatures, threshold)
    told = [
        query(node, protocol.QUERY_DEDUP_DROP, arrays=_drop_record(drops[node])) for node in nodes
    ]
    for reply in grid.send_and_receive(told):
        if reply.has_error():
            raise DedupError(
                f"site {reply.metadata.src_node_id} refused its drop list: {reply.error.reason}"
            )
    outcome = {
        node: SiteDedup(records=len(signatures[node]), dropped=int(drops[node].size))
        for node in nodes
    }
    log.info(
        "dedup: %s",
        ", ".join(f"site {n} dropped {s.dropped} of {s.records}" for n, s in outcome.items()),
    )
    return outcome


def _drop_record(rows: np.ndarray) -> ArrayRecord:
    return ArrayRecord({protocol.DEDUP_DROP: Array(rows.astype(np.int64))})


def _signatures_reply(reply: Message, node: int, num_perm: int) -> tuple[np.ndarray, str]:
    """A site's signatures and key check, checked at the edge: one uint32 array of num_perm columns."""
    content = reply.content
    arrays = [record.get(protocol.DEDUP_SIGNATURES) for record in content.array_records.values()]
    checks = [record.get(protocol.DEDUP_KEY_CHECK) for record in content.config_records.values()]
    if len(arrays) != 1 or arrays[0] is None or len(checks) != 1 or not isinstance(checks[0], str):
        raise DedupError(
            f"site {node}: a signatures reply holds one signature array and a key check"
        )
    signatures = arrays[0].numpy()
    if signatures.dtype != np.uint32 or signatures.ndim != 2 or signatures.shape[1] != num_perm:
        raise DedupError(
            f"site {node}: signatures must be uint32 [records, {num_perm}], got "
            f"{signatures.dtype} {list(signatures.shape)}"
        )
    return signatures, checks[0]


def _check_keys(checks: Mapping[int, str]) -> None:
    """Every site holds the key most of them hold; a site with another key could match no one."""
    common, _ = Counter(checks.values()).most_common(1)[0]
    odd = sorted(node for node, check in checks.items() if check != common)
    if odd:
        raise DedupError(
            f"site(s) {', '.join(map(str, odd))} hold a dedup key other than the other sites' (their key "
            "check differs); give every site the consortium's --dedup-key-file"
        )


def duplicate_pairs(
    signatures: Mapping[int, np.ndarray], threshold: float
) -> list[tuple[Record, Record]]:
    """Pairs of records at two different sites whose estimated Jaccard similarity is >= threshold."""
    from datasketch import LeanMinHash, MinHashLSH  # the dedup extra: only a run that deduplicates

    num_perm = next(iter(signatures.values())).shape[1]
    lsh = MinHashLSH(threshold=max(threshold - CANDIDATE_MARGIN, 0.05), num_perm=num_perm)
    sketches = {
        (node, row): LeanMinHash(hashvalues=values, seed=1, scheme="affine32")
        for node, rows in signatures.items()
        for row, values in enumerate(rows)
    }
    with lsh.insertion_session() as session:
        for key, sketch in sketches.items():
            session.insert(key, sketch, check_duplication=False)
    pairs = []
    for (node, row), sketch in sketches.items():
        for other in lsh.query(sketch):
            if other[0] == node or other < (node, row):
                continue
            estimate = float(np.mean(signatures[node][row] == signatures[other[0]][other[1]]))
            if estimate >= threshold:
                pairs.append(((node, row), other))
    return sorted(pairs)


def records_to_drop(
    signatures: Mapping[int, np.ndarray], threshold: float
) -> dict[int, np.ndarray]:
    """Per node, the rows it drops (sorted): every group of linked near copies keeps one record, at the site
    with the fewest records (then the lowest node id, then the first row)."""
    parent: dict[Record, Record] = {}

    def root(record: Record) -> Record:
        while parent.get(record, record) != record:
            record = parent[record]
        return record

    pairs = duplicate_pairs(signatures, threshold)
    for a, b in pairs:
        parent[root(b)] = root(a)
    groups: dict[Record, set[Record]] = {}
    for record in {record for pair in pairs for record in pair}:
        groups.setdefault(root(record), set()).add(record)
    size = {node: len(rows) for node, rows in signatures.items()}
    drops: dict[int, list[int]] = {node: [] for node in signatures}
    for members in groups.values():
        kept = min(members, key=lambda r: (size[r[0]], r[0], r[1]))
        for node, row in members - {kept}:
            drops[node].append(row)
    return {node: np.array(sorted(rows), dtype=np.int64) for node, rows in drops.items()}
