"""The coordinator's side of one secure-aggregation round, as a state machine with validation at every stage.

It holds public keys, encrypted shares it cannot open, the running field sum of the masked vectors (never one
site's vector beyond the call that adds it) and, at the end, the shares that remove the masks. Every
`receive_*` checks the whole message first and raises SecAggError without changing anything when it is
malformed, out of turn, from a site not in the round, or addressed to another site.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import hydrafl.secagg.crypto as crypto
import hydrafl.secagg.shamir as shamir
from hydrafl.secagg.params import SecAggError, SecAggParams, neighbours
from hydrafl.secagg.site import SEALED_BYTES, PublicKeys


@dataclass(kw_only=True)
class ServerSession:
    server_round: int
    participants: tuple[int, ...]
    params: SecAggParams
    length: int
    """Elements of every encoded vector in this round."""
    keys: dict[int, PublicKeys] = field(default_factory=dict)
    sealed: dict[int, dict[int, bytes]] = field(default_factory=dict, repr=False)
    """Per sender, its encrypted shares by recipient."""
    routed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Per site, the senders whose shares it was given: the sites it masks with."""
    masked: set[int] = field(default_factory=set)
    total: np.ndarray | None = field(default=None, repr=False)
    revealed: dict[int, dict[int, bytes]] = field(default_factory=dict, repr=False)
    """Per unmasking site, the shares it revealed by owner."""

    @classmethod
    def start(cls, server_round: int, participants: list[int], params: SecAggParams, length: int) -> "ServerSession":
        ordered = tuple(sorted(int(p) for p in participants))
        if len(set(ordered)) != len(ordered) or length < 1:
            raise SecAggError(f"a round needs distinct participants and a vector length >= 1, got {list(ordered)}, {length}")
        params.check_round(len(ordered))
        return cls(server_round=server_round, participants=ordered, params=params, length=length)

    @property
    def threshold(self) -> int:
        return self.params.threshold(len(self.participants))

    def neighbourhood(self, node: int) -> tuple[int, ...]:
        return neighbours(self.participants, node, self.params.shares(len(self.participants)))

    def receive_keys(self, node: int, keys: PublicKeys) -> None:
        self._require_participant(node)
        if node in self.keys:
            raise SecAggError(f"site {node} already sent its public keys this round")
        if len(keys) != 2 or any(not isinstance(k, bytes) or len(k) != crypto.KEY_BYTES for k in keys):
            raise SecAggError(f"site {node}: public keys must be two {crypto.KEY_BYTES}-byte X25519 keys")
        self.keys[node] = (keys[0], keys[1])

    def keys_for(self, node: int) -> dict[int, PublicKeys]:
        """The public keys `node` shares with: its neighbours' (and its own) that arrived."""
        return {peer: self.keys[peer] for peer in self.neighbourhood(node) if peer in self.keys}

    def receive_shares(self, node: int, sealed: dict[int, bytes]) -> None:
        self._require_participant(node)
        if node not in self.keys or node in self.sealed or self.routed:
            raise SecAggError(f"site {node}: encrypted shares out of turn")
        expected = set(self.keys_for(node)) - {node}
        if set(sealed) != expected:
            raise SecAggError(
                f"site {node}: shares addressed to {sorted(sealed)}, expected exactly its neighbours {sorted(expected)}"
            )
        if any(not isinstance(blob, bytes) or len(blob) != SEALED_BYTES for blob in sealed.values()):
            raise SecAggError(f"site {node}: every encrypted share must be {SEALED_BYTES} bytes")
        self.sealed[node] = dict(sealed)

    def shares_for(self, node: int) -> dict[int, bytes]:
        """The encrypted shares addressed to `node`, which masks with their senders; fixed once routed."""
        if node not in self.sealed:
            raise SecAggError(f"site {node} shared no keys this round: it cannot send a masked vector")
        if node not in self.routed:
            self.routed[node] = tuple(src for src in sorted(self.sealed) if node in self.sealed[src])
        return {src: self.sealed[src][node] for src in self.routed[node]}

    def receive_masked(self, node: int, vector: np.ndarray) -> None:
        """Adds `node`'s masked vector to the running sum."""
        self._require_participant(node)
        if node not in self.routed or node in self.masked or self.revealed:
            raise SecAggError(f"site {node}: a masked vector out of turn")
        if not isinstance(vector, np.ndarray) or vector.dtype != np.uint32 or vector.shape != (self.length,):
            raise SecAggError(f"site {node}: a masked vector must be uint32 of shape ({self.length},)")
        self.total = vector.copy() if self.total is None else self.total + vector
        self.masked.add(node)

    def unmask_request(self) -> tuple[list[int], list[int]]:
        """(survivors, dropped): who sent masked vectors, and who shared keys (so others masked with them) but
        sent none. Raises SecAggError, the round halting, when survivors are fewer than the threshold."""
        survivors = sorted(self.masked)
        if len(survivors) < self.threshold:
            raise SecAggError(
                f"round {self.server_round}: only {len(survivors)} of {len(self.participants)} sites sent masked "
                f"vectors, the reconstruction threshold is {self.threshold}; the round halts and applies nothing"
            )
        return survivors, sorted(set(self.sealed) - self.masked)

    def receive_unmask(self, node: int, revealed: dict[int, bytes]) -> None:
        survivors, dropped = self.unmask_request()
        if node not in self.masked or node in self.revealed:
            raise SecAggError(f"site {node}: unmasking shares out of turn")
        expected = (set(self.routed[node]) | {node}) & (set(survivors) | set(dropped))
        if set(revealed) != expected:
            raise SecAggError(f"site {node}: revealed shares of {sorted(revealed)}, expected exactly {sorted(expected)}")
        if any(not isinstance(share, bytes) or len(share) != shamir.SHARE_BYTES for share in revealed.values()):
            raise SecAggError(f"site {node}: every revealed share must be {shamir.SHARE_BYTES} bytes")
        self.revealed[node] = dict(revealed)

    def result(self) -> tuple[np.ndarray, int]:
        """(the field sum of the survivors' encoded vectors, how many survivors): every mask removed."""
        survivors, dropped = self.unmask_request()
        total = self.total.copy()
        for node in survivors:
            seed = self._rebuild(node)
            total -= crypto.mask(seed, self.length)
        for node in dropped:
            mask_key = self._rebuild(node)
            if crypto.public_key(mask_key) != self.keys[node][1]:
                raise SecAggError(f"the rebuilt key of dropped site {node} does not match its public key")
            for peer in survivors:
                if node in self.routed[peer]:  # peer added its pairwise mask with node; take it back out
                    pairwise = crypto.mask(crypto.agree(mask_key, self.keys[peer][1], b"mask"), self.length)
                    total = total - pairwise if peer < node else total + pairwise
        return total, len(survivors)

    def _rebuild(self, owner: int) -> bytes:
        shares = {self.participants.index(holder) + 1: revealed[owner]
                  for holder, revealed in self.revealed.items() if owner in revealed}
        if len(shares) < self.threshold:
            raise SecAggError(
                f"round {self.server_round}: {len(shares)} shares of site {owner}'s secret arrived, "
                f"{self.threshold} needed; the round halts and applies nothing"
            )
        return shamir.combine(shares, self.threshold)

    def _require_participant(self, node: int) -> None:
        if node not in self.participants:
            raise SecAggError(f"site {node} is not in round {self.server_round}'s secure aggregation")
