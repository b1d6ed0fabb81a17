"""A site's side of one secure-aggregation round, as a state machine: keys -> shared -> masked -> done.

Each call checks what the coordinator sent before changing anything, and the session answers the unmask stage
once: a site never reveals both the self-mask share and the key share of the same site, so a coordinator that
lies about who dropped can learn no single site's update.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field

import numpy as np

import hydrafl.secagg.crypto as crypto
import hydrafl.secagg.shamir as shamir
from hydrafl.secagg.params import SecAggError, SecAggParams, neighbours

PublicKeys = tuple[bytes, bytes]
"""(share-encryption key, mask-agreement key) of one site, X25519 raw bytes."""

_ID_BYTES = 8
PLAIN_BYTES = 2 * _ID_BYTES + 2 * shamir.SHARE_BYTES
SEALED_BYTES = crypto.NONCE_BYTES + PLAIN_BYTES + 16
"""One encrypted share pair on the wire (AES-GCM nonce + plaintext + tag)."""


def associated(server_round: int, src: int, dst: int) -> bytes:
    """What an encrypted share is bound to: a share sealed for one site or round opens for no other."""
    return f"hydrafl-secagg|{server_round}|{src}|{dst}".encode()


@dataclass(kw_only=True)
class SiteSession:
    node: int
    server_round: int
    participants: tuple[int, ...]
    params: SecAggParams
    share_key: bytes = field(default_factory=crypto.new_private_key, repr=False)
    mask_key: bytes = field(default_factory=crypto.new_private_key, repr=False)
    self_seed: bytes = field(default_factory=lambda: os.urandom(crypto.KEY_BYTES), repr=False)
    stage: str = "keys"
    peer_keys: dict[int, PublicKeys] = field(default_factory=dict)
    held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)
    """Per site whose shares this site holds (itself included): (key share, self-mask share)."""

    @classmethod
    def start(cls, node: int, server_round: int, participants: list[int], params: SecAggParams) -> "SiteSession":
        """A new round: fresh keys; refuses a round this site is not in or that the parameters cannot run."""
        ordered = tuple(sorted(int(p) for p in participants))
        if node not in ordered or len(set(ordered)) != len(ordered):
            raise SecAggError(f"site {node} is not among the round's distinct participants {list(ordered)}")
        params.check_round(len(ordered))
        return cls(node=node, server_round=server_round, participants=ordered, params=params)

    def public_keys(self) -> PublicKeys:
        return crypto.public_key(self.share_key), crypto.public_key(self.mask_key)

    def share_keys(self, public_keys: dict[int, PublicKeys]) -> dict[int, bytes]:
        """Encrypted shares of this site's mask key and self-mask seed, one per neighbour that sent keys."""
        self._expect("keys")
        mine = neighbours(self.participants, self.node, self.params.shares(len(self.participants)))
        if public_keys.get(self.node) != self.public_keys():
            raise SecAggError(f"site {self.node}: the key list does not hold this site's own public keys")
        strangers = sorted(set(public_keys) - set(mine))
        if strangers:
            raise SecAggError(f"site {self.node}: public keys from sites outside its neighbourhood: {strangers}")
        self._require_threshold(len(public_keys), "neighbours sent keys")
        for peer, keys in public_keys.items():
            if len(keys) != 2 or any(len(key) != crypto.KEY_BYTES for key in keys):
                raise SecAggError(f"site {self.node}: malformed public keys from site {peer}")
        peers = sorted(public_keys)
        xs = [self._x(peer) for peer in peers]
        key_shares = shamir.split(self.mask_key, xs, self._threshold())
        seed_shares = shamir.split(self.self_seed, xs, self._threshold())
        sealed = {}
        for peer, x in zip(peers, xs):
            if peer == self.node:
                continue
            plain = _ids(self.node, peer) + key_shares[x] + seed_shares[x]
            secret = crypto.agree(self.share_key, public_keys[peer][0], b"share")
            sealed[peer] = crypto.seal(secret, plain, associated(self.server_round, self.node, peer))
        x = self._x(self.node)
        self.peer_keys = dict(public_keys)
        self.held = {self.node: (key_shares[x], seed_shares[x])}
        self.stage = "shared"
        return sealed

    def mask(self, encoded: np.ndarray, sealed: dict[int, bytes]) -> np.ndarray:
        """`encoded` plus this site's self-mask and its pairwise masks with every site whose shares arrived."""
        self._expect("shared")
        if not isinstance(encoded, np.ndarray) or encoded.dtype != np.uint32 or encoded.ndim != 1:
            raise SecAggError("the encoded update must be a 1-D uint32 vector")
        opened = {}
        for src, blob in sealed.items():
            if src == self.node or src not in self.peer_keys:
                raise SecAggError(f"site {self.node}: a share from site {src}, which is not one of its neighbours")
            secret = crypto.agree(self.share_key, self.peer_keys[src][0], b"share")
            plain = crypto.open_sealed(secret, bytes(blob), associated(self.server_round, src, self.node))
            if plain[: 2 * _ID_BYTES] != _ids(src, self.node) or len(plain) != PLAIN_BYTES:
                raise SecAggError(f"site {self.node}: the share from site {src} names another sender or recipient")
            body = plain[2 * _ID_BYTES:]
            opened[src] = (body[: shamir.SHARE_BYTES], body[shamir.SHARE_BYTES:])
        self._require_threshold(len(opened) + 1, "neighbours sent shares")
        masked = encoded + crypto.mask(self.self_seed, encoded.size)
        for peer in opened:
            pairwise = crypto.mask(crypto.agree(self.mask_key, self.peer_keys[peer][1], b"mask"), encoded.size)
            masked = masked + pairwise if self.node < peer else masked - pairwise
        self.held.update(opened)
        self.stage = "masked"
        return masked

    def unmask(self, survivors: list[int], dropped: list[int]) -> dict[int, bytes]:
        """The self-mask share of each survivor and the key share of each dropped site this site holds; once."""
        self._expect("masked")
        alive, gone = set(survivors), set(dropped)
        if self.node not in alive or alive & gone or not (alive | gone) <= set(self.participants):
            raise SecAggError(f"site {self.node}: inconsistent unmask request (survivors {sorted(alive)}, dropped {sorted(gone)})")
        self._require_threshold(len(alive), "sites survived")
        self.stage = "done"
        revealed = {node: shares[1] for node, shares in self.held.items() if node in alive}
        revealed.update({node: shares[0] for node, shares in self.held.items() if node in gone})
        return revealed

    def to_state(self) -> str:
        """The session as text, for a site's persistent Context between a round's messages."""
        return json.dumps({
            "node": self.node, "server_round": self.server_round, "participants": list(self.participants),
            "params": self.params.to_config(), "stage": self.stage,
            "keys": [_text(self.share_key), _text(self.mask_key), _text(self.self_seed)],
            "peer_keys": {str(p): [_text(k) for k in keys] for p, keys in self.peer_keys.items()},
            "held": {str(p): [_text(s) for s in shares] for p, shares in self.held.items()},
        })

    @classmethod
    def from_state(cls, text: str) -> "SiteSession":
        data = json.loads(text)
        share_key, mask_key, self_seed = (base64.b64decode(raw) for raw in data["keys"])
        return cls(
            node=data["node"], server_round=data["server_round"], participants=tuple(data["participants"]),
            params=SecAggParams.from_config(data["params"]), stage=data["stage"],
            share_key=share_key, mask_key=mask_key, self_seed=self_seed,
            peer_keys={int(p): tuple(base64.b64decode(k) for k in keys) for p, keys in data["peer_keys"].items()},
            held={int(p): tuple(base64.b64decode(s) for s in shares) for p, shares in data["held"].items()},
        )

    def _x(self, node: int) -> int:
        return self.participants.index(node) + 1

    def _threshold(self) -> int:
        return self.params.threshold(len(self.participants))

    def _require_threshold(self, count: int, what: str) -> None:
        if count < self._threshold():
            raise SecAggError(
                f"site {self.node}: only {count} {what}, the reconstruction threshold is {self._threshold()}; "
                "the round halts"
            )

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggError(f"site {self.node}: a {stage!r}-stage message arrived in stage {self.stage!r}")


def _text(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _ids(src: int, dst: int) -> bytes:
    return src.to_bytes(_ID_BYTES, "big") + dst.to_bytes(_ID_BYTES, "big")
