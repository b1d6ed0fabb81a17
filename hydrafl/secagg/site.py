"""A site's side of one secure-aggregation round, as a state machine: keys -> shared -> masked -> checked -> done.

It trusts the coordinator with nothing: every peer's keys must carry the consortium's certificate and the peer's
signature over this round's setup; it signs one survivor set, once, and reveals shares only for that set, after
checking that at least a threshold of its neighbours signed it. So a site never reveals both the self-mask share
and the key share of the same site, and no two sites reveal under different survivor sets: with a threshold
above half the shares, a coordinator that lies about who dropped can learn no single site's update.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

import hydrafl.secagg.crypto as crypto
import hydrafl.secagg.shamir as shamir
from hydrafl.secagg.identity import SIGNATURE_BYTES, SiteIdentity, seed_commitment, verify
from hydrafl.secagg.params import SecAggError, SecAggParams, neighbours

_ID_BYTES = 8
PLAIN_BYTES = 2 * _ID_BYTES + 2 * shamir.SHARE_BYTES
SEALED_BYTES = crypto.NONCE_BYTES + PLAIN_BYTES + 16
"""One encrypted share pair on the wire (AES-GCM nonce + plaintext + tag)."""


@dataclass(frozen=True, slots=True)
class SignedKeys:
    """One site's key material for a round, as the coordinator routes it to the site's neighbours."""

    share_key: bytes
    """X25519: encrypts the shares sent to this site."""
    mask_key: bytes
    """X25519: agrees the pairwise masks."""
    commitment: bytes
    """SHA-256 of the self-mask seed (`seed_commitment`): a rebuilt seed is checked against it."""
    signing_key: bytes
    """Ed25519 public key of the site's identity."""
    certificate: bytes
    """The consortium's signature binding `signing_key` to the site's node id."""
    signature: bytes
    """The site's signature over the round's setup and the three fields above (`keys_statement`)."""

    SIZES = (crypto.KEY_BYTES, crypto.KEY_BYTES, 32, 32, SIGNATURE_BYTES, SIGNATURE_BYTES)

    def check_sizes(self) -> None:
        if any(
            not isinstance(v, bytes) or len(v) != n
            for v, n in zip(self.fields(), self.SIZES, strict=True)
        ):
            raise SecAggError(
                f"malformed key material: fields of {list(self.SIZES)} bytes expected"
            )

    def fields(self) -> tuple[bytes, ...]:
        return (
            self.share_key,
            self.mask_key,
            self.commitment,
            self.signing_key,
            self.certificate,
            self.signature,
        )


def setup_digest(server_round: int, participants: tuple[int, ...], params: SecAggParams) -> bytes:
    """What every signature of a round is bound to: its number, its participants and its parameters (so a
    coordinator cannot give two sites two different thresholds or participant lists)."""
    text = json.dumps([server_round, list(participants), params.to_config()], sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


def keys_statement(
    setup: bytes, node: int, share_key: bytes, mask_key: bytes, commitment: bytes
) -> bytes:
    return b"hydrafl-secagg-keys|" + setup + _id(node) + share_key + mask_key + commitment


def survivors_statement(setup: bytes, survivors: list[int] | tuple[int, ...]) -> bytes:
    return b"hydrafl-secagg-survivors|" + setup + b"".join(_id(node) for node in sorted(survivors))


def associated(server_round: int, src: int, dst: int) -> bytes:
    """What an encrypted share is bound to: a share sealed for one site or round opens for no other."""
    return f"hydrafl-secagg|{server_round}|{src}|{dst}".encode()


@dataclass(kw_only=True)
class SiteSession:
    node: int
    server_round: int
    participants: tuple[int, ...]
    params: SecAggParams
    identity: SiteIdentity = field(repr=False)
    share_key: bytes = field(default_factory=crypto.new_private_key, repr=False)
    mask_key: bytes = field(default_factory=crypto.new_private_key, repr=False)
    self_seed: bytes = field(default_factory=lambda: os.urandom(crypto.KEY_BYTES), repr=False)
    stage: str = "keys"
    peer_keys: dict[int, SignedKeys] = field(default_factory=dict)
    """The verified key material of each neighbour that sent some (this site's own included)."""
    held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)
    """Per site whose shares this site holds (itself included): (key share, self-mask share)."""
    survivors: tuple[int, ...] = ()
    """The one survivor set this site signed."""

    @classmethod
    def start(
        cls,
        node: int,
        server_round: int,
        participants: list[int],
        params: SecAggParams,
        identity: SiteIdentity,
    ) -> SiteSession:
        """A new round: fresh keys; refuses a round this site is not in, one its identity is not for, or one the
        parameters cannot run (a threshold at or below half the shares among them)."""
        ordered = tuple(sorted(int(p) for p in participants))
        if node not in ordered or len(set(ordered)) != len(ordered):
            raise SecAggError(
                f"site {node} is not among the round's distinct participants {list(ordered)}"
            )
        if identity.node != node:
            raise SecAggError(
                f"site {node}: its secure-aggregation identity is for node {identity.node}"
            )
        params.check_round(len(ordered))
        return cls(
            node=node,
            server_round=server_round,
            participants=ordered,
            params=params,
            identity=identity,
        )

    @property
    def setup(self) -> bytes:
        return setup_digest(self.server_round, self.participants, self.params)

    def public_keys(self) -> SignedKeys:
        """This site's key material for the round, signed."""
        share, mask = crypto.public_key(self.share_key), crypto.public_key(self.mask_key)
        commitment = seed_commitment(self.server_round, self.node, self.self_seed)
        signature = self.identity.sign(
            keys_statement(self.setup, self.node, share, mask, commitment)
        )
        return SignedKeys(
            share, mask, commitment, self.identity.public_key, self.identity.certificate, signature
        )

    def share_keys(self, public_keys: dict[int, SignedKeys]) -> dict[int, bytes]:
        """Encrypted shares of this site's mask key and self-mask seed, one per neighbour whose keys the
        consortium's certificate and the neighbour's own signature vouch for; any other key refuses the round."""
        self._expect("keys")
        mine = neighbours(self.participants, self.node, self.params.shares(len(self.participants)))
        if public_keys.get(self.node) != self.public_keys():
            raise SecAggError(
                f"site {self.node}: the key list does not hold this site's own public keys"
            )
        strangers = sorted(set(public_keys) - set(mine))
        if strangers:
            raise SecAggError(
                f"site {self.node}: public keys from sites outside its neighbourhood: {strangers}"
            )
        self._require_threshold(len(public_keys), "neighbours sent keys")
        for peer, keys in public_keys.items():
            keys.check_sizes()
            self.identity.check_peer(peer, keys.signing_key, keys.certificate)
            verify(
                keys.signing_key,
                keys.signature,
                keys_statement(self.setup, peer, keys.share_key, keys.mask_key, keys.commitment),
                f"site {self.node}: the round keys of site {peer}",
            )
        peers = sorted(public_keys)
        xs = [self._x(peer) for peer in peers]
        key_shares = shamir.split(self.mask_key, xs, self._threshold())
        seed_shares = shamir.split(self.self_seed, xs, self._threshold())
        sealed = {}
        for peer, x in zip(peers, xs, strict=True):
            if peer == self.node:
                continue
            plain = _ids(self.node, peer) + key_shares[x] + seed_shares[x]
            secret = crypto.agree(self.share_key, public_keys[peer].share_key, b"share")
            sealed[peer] = crypto.seal(
                secret, plain, associated(self.server_round, self.node, peer)
            )
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
        return crypto.apply_masks(encoded.copy(), 0, self.masks(sealed))

    def masks(self, sealed: dict[int, bytes]) -> crypto.Masks:
        """The masks `mask` adds (`crypto.Masks`), from the shares routed to this site: its self-mask and its
        pairwise masks with every site whose shares arrived. A vector larger than memory is masked a window at
        a time with them (`crypto.apply_masks`)."""
        self._expect("shared")
        opened = {}
        for src, blob in sealed.items():
            if src == self.node or src not in self.peer_keys:
                raise SecAggError(
                    f"site {self.node}: a share from site {src}, which is not one of its neighbours"
                )
            secret = crypto.agree(self.share_key, self.peer_keys[src].share_key, b"share")
            plain = crypto.open_sealed(
                secret, bytes(blob), associated(self.server_round, src, self.node)
            )
            if plain[: 2 * _ID_BYTES] != _ids(src, self.node) or len(plain) != PLAIN_BYTES:
                raise SecAggError(
                    f"site {self.node}: the share from site {src} names another sender or recipient"
                )
            body = plain[2 * _ID_BYTES :]
            opened[src] = (body[: shamir.SHARE_BYTES], body[shamir.SHARE_BYTES :])
        self._require_threshold(len(opened) + 1, "neighbours sent shares")
        masks = [(self.self_seed, True)]
        masks += [
            (crypto.agree(self.mask_key, self.peer_keys[peer].mask_key, b"mask"), self.node < peer)
            for peer in opened
        ]
        self.held.update(opened)
        self.stage = "masked"
        return masks

    def sign_survivors(self, survivors: list[int]) -> bytes:
        """The consistency check: this site's signature over the survivor set, given once. It refuses a set
        without itself or with fewer than a threshold of its neighbours."""
        self._expect("masked")
        alive = set(survivors)
        if (
            self.node not in alive
            or len(alive) != len(survivors)
            or not alive <= set(self.participants)
        ):
            raise SecAggError(f"site {self.node}: inconsistent survivor set {sorted(alive)}")
        self._require_threshold(len(alive & set(self.peer_keys)), "neighbours survived")
        self.survivors = tuple(sorted(alive))
        self.stage = "checked"
        return self.identity.sign(survivors_statement(self.setup, self.survivors))

    def unmask(self, survivors: list[int], signatures: dict[int, bytes]) -> dict[int, bytes]:
        """The self-mask share of each survivor and the key share of each other site this site holds shares of;
        once, and only for the set it signed, when at least a threshold of its neighbours signed that same set."""
        self._expect("checked")
        if tuple(sorted(set(survivors))) != self.survivors or len(survivors) != len(self.survivors):
            raise SecAggError(
                f"site {self.node}: asked to unmask for survivors {sorted(set(survivors))}, "
                f"but it signed {list(self.survivors)}"
            )
        if not set(signatures) <= set(self.survivors) or self.node not in signatures:
            raise SecAggError(
                f"site {self.node}: survivor signatures from {sorted(signatures)}, outside the survivors"
            )
        statement = survivors_statement(self.setup, self.survivors)
        signers = set(signatures) & set(self.peer_keys)
        for signer in signers:
            verify(
                self.peer_keys[signer].signing_key,
                signatures[signer],
                statement,
                f"site {self.node}: site {signer}'s survivor set",
            )
        self._require_threshold(len(signers), "neighbours signed the survivor set")
        self.stage = "done"
        return {
            node: shares[1] if node in self.survivors else shares[0]
            for node, shares in self.held.items()
        }

    def to_state(self) -> str:
        """The session as text, for a site's persistent Context between a round's messages."""
        return json.dumps(
            {
                "node": self.node,
                "server_round": self.server_round,
                "participants": list(self.participants),
                "params": self.params.to_config(),
                "stage": self.stage,
                "keys": [_text(self.share_key), _text(self.mask_key), _text(self.self_seed)],
                "peer_keys": {
                    str(p): [_text(k) for k in keys.fields()] for p, keys in self.peer_keys.items()
                },
                "held": {str(p): [_text(s) for s in shares] for p, shares in self.held.items()},
                "survivors": list(self.survivors),
            }
        )

    @classmethod
    def from_state(cls, text: str, identity: SiteIdentity) -> SiteSession:
        """The session `to_state` wrote; the identity is the site's own, kept apart from any one round."""
        data = json.loads(text)
        share_key, mask_key, self_seed = (base64.b64decode(raw) for raw in data["keys"])
        return cls(
            node=data["node"],
            server_round=data["server_round"],
            participants=tuple(data["participants"]),
            params=SecAggParams.from_config(data["params"]),
            stage=data["stage"],
            identity=identity,
            share_key=share_key,
            mask_key=mask_key,
            self_seed=self_seed,
            peer_keys={
                int(p): SignedKeys(*(base64.b64decode(k) for k in keys))
                for p, keys in data["peer_keys"].items()
            },
            held={
                int(p): tuple(base64.b64decode(s) for s in shares)
                for p, shares in data["held"].items()
            },
            survivors=tuple(data["survivors"]),
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
            raise SecAggError(
                f"site {self.node}: a {stage!r}-stage message arrived in stage {self.stage!r}"
            )


def _text(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _id(node: int) -> bytes:
    return node.to_bytes(_ID_BYTES, "big")


def _ids(src: int, dst: int) -> bytes:
    return _id(src) + _id(dst)
