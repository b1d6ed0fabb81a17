"""The coordinator's side of one secure-aggregation round, as a state machine with validation at every stage.

It holds signed public keys it only routes, encrypted shares it cannot open, the running field sum of the masked
vectors (`FieldSum`, in memory or in a file; never one site's vector beyond the call that adds it), the
survivors' signatures over the survivor set and, at the end, the shares that remove the masks. Every `receive_*`
checks the whole message first and raises SecAggError without changing anything when it is malformed, out of
turn, from a site not in the round, or addressed to another site. Every rebuilt secret is checked against what
its owner signed: a corrupt share is outvoted and its sender named when spare shares arrived, and halts the
round otherwise. Unmasking is a window at a time too (`Unmasked`): each mask's words are made for the window
that needs them (`crypto.mask_range`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import hydrafl.secagg.crypto as crypto
import hydrafl.secagg.shamir as shamir
from hydrafl.secagg.field_sum import FieldSum, Words
from hydrafl.secagg.identity import SIGNATURE_BYTES, seed_commitment, verify
from hydrafl.secagg.params import SecAggError, SecAggParams, neighbours
from hydrafl.secagg.site import SEALED_BYTES, SignedKeys, setup_digest, survivors_statement

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServerSession:
    server_round: int
    participants: tuple[int, ...]
    params: SecAggParams
    length: int
    """Elements of every encoded vector in this round."""
    keys: dict[int, SignedKeys] = field(default_factory=dict)
    sealed: dict[int, dict[int, bytes]] = field(default_factory=dict, repr=False)
    """Per sender, its encrypted shares by recipient."""
    routed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Per site, the senders whose shares it was given: the sites it masks with."""
    total: FieldSum
    """The running sum of the masked vectors received."""
    masked: set[int] = field(default_factory=set)
    survivors: tuple[int, ...] = ()
    """The survivor set the consistency check asks the sites to sign; fixed once asked."""
    signatures: dict[int, bytes] = field(default_factory=dict, repr=False)
    """Per survivor that signed the survivor set, its signature."""
    revealed: dict[int, dict[int, bytes]] = field(default_factory=dict, repr=False)
    """Per unmasking site, the shares it revealed by owner."""
    culprits: set[int] = field(default_factory=set)
    """Sites that revealed a share disagreeing with the secret its owner committed to."""

    @classmethod
    def start(
        cls,
        server_round: int,
        participants: list[int],
        params: SecAggParams,
        length: int,
        total: FieldSum | None = None,
    ) -> ServerSession:
        """A round's session; the masked vectors are summed into `total` (an empty sum of `length` words, in
        a file for vectors larger than memory), by default one in memory."""
        ordered = tuple(sorted(int(p) for p in participants))
        if len(set(ordered)) != len(ordered) or length < 1:
            raise SecAggError(
                f"a round needs distinct participants and a vector length >= 1, got {list(ordered)}, {length}"
            )
        params.check_round(len(ordered))
        total = FieldSum(length) if total is None else total
        if total.length != length:
            raise SecAggError(f"a sum of {total.length} words for vectors of {length}")
        return cls(
            server_round=server_round,
            participants=ordered,
            params=params,
            length=length,
            total=total,
        )

    @property
    def threshold(self) -> int:
        return self.params.threshold(len(self.participants))

    def neighbourhood(self, node: int) -> tuple[int, ...]:
        return neighbours(self.participants, node, self.params.shares(len(self.participants)))

    def receive_keys(self, node: int, keys: SignedKeys) -> None:
        """Stores `node`'s key material, to route; the sites, not the coordinator, check its certificate."""
        self._require_participant(node)
        if node in self.keys:
            raise SecAggError(f"site {node} already sent its public keys this round")
        keys.check_sizes()
        self.keys[node] = keys

    def keys_for(self, node: int) -> dict[int, SignedKeys]:
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
        if any(
            not isinstance(blob, bytes) or len(blob) != SEALED_BYTES for blob in sealed.values()
        ):
            raise SecAggError(f"site {node}: every encrypted share must be {SEALED_BYTES} bytes")
        self.sealed[node] = dict(sealed)

    def shares_for(self, node: int) -> dict[int, bytes]:
        """The encrypted shares addressed to `node`, which masks with their senders; fixed once routed."""
        if node not in self.sealed:
            raise SecAggError(
                f"site {node} shared no keys this round: it cannot send a masked vector"
            )
        if node not in self.routed:
            self.routed[node] = tuple(
                src for src in sorted(self.sealed) if node in self.sealed[src]
            )
        return {src: self.sealed[src][node] for src in self.routed[node]}

    def receive_masked(self, node: int, vector: np.ndarray | Words) -> None:
        """Adds `node`'s masked vector to the running sum: an array, or a reader of its words (`Words`), which
        is read a window at a time (a vector larger than memory). A vector that fails to read, or has a window
        that is not uint32 words, fails its site and leaves the sum as it was."""
        self._require_participant(node)
        if node not in self.routed or node in self.masked or self.survivors:
            raise SecAggError(f"site {node}: a masked vector out of turn")
        if isinstance(vector, np.ndarray) or not callable(vector):
            if (
                not isinstance(vector, np.ndarray)
                or vector.dtype != np.uint32
                or vector.shape != (self.length,)
            ):
                raise SecAggError(
                    f"site {node}: a masked vector must be uint32 of shape ({self.length},)"
                )
            array = vector
            vector = lambda offset, count: array[offset : offset + count]  # noqa: E731
        try:
            self.total.add(vector)
        except SecAggError as error:
            raise SecAggError(f"site {node}: {error}") from None
        self.masked.add(node)

    def check_request(self) -> list[int]:
        """The survivor set (who sent masked vectors), fixed from now on, for each survivor to sign. Raises
        SecAggError, the round halting, when survivors are fewer than the threshold."""
        if not self.survivors:
            self._require_enough(len(self.masked), "sent masked vectors")
            self.survivors = tuple(sorted(self.masked))
        return list(self.survivors)

    def receive_signature(self, node: int, signature: bytes) -> None:
        """Keeps a survivor's signature over the survivor set once it verifies under the key it routed: a bad
        one leaves that site out of unmasking instead of making its peers refuse the round."""
        if node not in self.survivors or node in self.signatures:
            raise SecAggError(f"site {node}: a survivor-set signature out of turn")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise SecAggError(f"site {node}: a signature must be {SIGNATURE_BYTES} bytes")
        verify(
            self.keys[node].signing_key,
            signature,
            survivors_statement(self._setup(), self.survivors),
            f"site {node}'s survivor set",
        )
        self.signatures[node] = signature

    def unmask_request(self) -> tuple[list[int], dict[int, bytes]]:
        """(survivors, their signatures over that set): what each signer checks before it reveals shares.
        Raises SecAggError, the round halting, when fewer than the threshold signed."""
        self._require_enough(len(self.signatures), "signed the survivor set")
        return list(self.survivors), dict(self.signatures)

    def receive_unmask(self, node: int, revealed: dict[int, bytes]) -> None:
        if node not in self.signatures or node in self.revealed:
            raise SecAggError(f"site {node}: unmasking shares out of turn")
        expected = set(self.routed[node]) | {node}
        if set(revealed) != expected:
            raise SecAggError(
                f"site {node}: revealed shares of {sorted(revealed)}, expected exactly {sorted(expected)}"
            )
        if any(
            not isinstance(share, bytes) or len(share) != shamir.SHARE_BYTES
            for share in revealed.values()
        ):
            raise SecAggError(
                f"site {node}: every revealed share must be {shamir.SHARE_BYTES} bytes"
            )
        self.revealed[node] = dict(revealed)

    def result(self) -> tuple[np.ndarray, int]:
        """(the field sum of the survivors' encoded vectors, how many survivors), whole (`unmasked`)."""
        unmasked, count = self.unmasked()
        return unmasked.read(0, self.length), count

    def unmasked(self) -> tuple[Unmasked, int]:
        """(the field sum of the survivors' encoded vectors, read a window at a time; how many survivors): every
        mask removed, each from a secret that matches what its owner signed."""
        self.unmask_request()
        masks: crypto.Masks = []
        for node in self.survivors:
            signed = self.keys[node].commitment
            seed = self._rebuild(
                node,
                lambda s, node=node, signed=signed: (
                    seed_commitment(self.server_round, node, s) == signed
                ),
            )
            masks.append((seed, True))
        for node in sorted(set(self.sealed) - set(self.survivors)):
            public = self.keys[node].mask_key
            mask_key = self._rebuild(node, lambda k, public=public: crypto.public_key(k) == public)
            masks.extend(  # each survivor that masked with node added a pairwise mask; take it back out
                (crypto.agree(mask_key, self.keys[peer].mask_key, b"mask"), peer < node)
                for peer in self.survivors
                if node in self.routed[peer]
            )
        return Unmasked(self.total, masks), len(self.survivors)

    def _rebuild(self, owner: int, valid: Callable[[bytes], bool]) -> bytes:
        """`owner`'s secret, which `valid` checks against its signed key material; the holders of shares that
        disagree with it are named and kept in `culprits`."""
        holders = {
            self.participants.index(holder) + 1: holder
            for holder, revealed in self.revealed.items()
            if owner in revealed
        }
        if len(holders) < self.threshold:
            raise SecAggError(
                f"round {self.server_round}: {len(holders)} shares of site {owner}'s secret arrived, "
                f"{self.threshold} needed; the round halts and applies nothing"
            )
        shares = {x: self.revealed[holder][owner] for x, holder in holders.items()}
        try:
            secret, bad = shamir.recover(shares, self.threshold, valid)
        except SecAggError as error:
            raise SecAggError(
                f"round {self.server_round}: site {owner}'s secret: {error}; the round halts and "
                "applies nothing"
            ) from None
        for x in bad:
            log.warning(
                "round %d: site %d revealed a corrupt share of site %d's secret; it is outvoted",
                self.server_round,
                holders[x],
                owner,
            )
            self.culprits.add(holders[x])
        return secret

    def _require_enough(self, count: int, what: str) -> None:
        if count < self.threshold:
            raise SecAggError(
                f"round {self.server_round}: only {count} of {len(self.participants)} sites {what}, the "
                f"reconstruction threshold is {self.threshold}; the round halts and applies nothing"
            )

    def _setup(self) -> bytes:
        return setup_digest(self.server_round, self.participants, self.params)

    def _require_participant(self, node: int) -> None:
        if node not in self.participants:
            raise SecAggError(
                f"site {node} is not in round {self.server_round}'s secure aggregation"
            )


@dataclass(frozen=True)
class Unmasked:
    """The masked sum less `masks`, read a window at a time."""

    total: FieldSum
    masks: crypto.Masks = field(repr=False)

    def read(self, offset: int, count: int) -> np.ndarray:
        """Words [offset, offset + count) of the unmasked sum."""
        return crypto.apply_masks(self.total.read(offset, count), offset, self.masks, remove=True)
