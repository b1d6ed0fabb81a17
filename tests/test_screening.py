"""Screening before aggregation: the norm and cosine tests against hand-computed numbers (whole and
subnetwork-shaped updates), and in real rounds (in-process sites, some of them attacking or sending NaN): the
rejected replies are kept out with their site and reason recorded, logged, and told to a grid that audits."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import SMALL_RUN

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.server.aggregation.screening import (
    AuditsRejections,
    Screening,
    cosines_to_mean,
    update_norm,
)
from hydrafl.simulation.attacks import Attack, AttackedGrid
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.validation import ConfigError


def _honest(sites: int = 6, seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=40)
    return {
        node: {"w": (direction + 0.3 * rng.normal(size=40)).astype(np.float32)}
        for node in range(1, sites + 1)
    }


def test_a_scaled_update_is_rejected_by_its_norm_with_the_reason():
    updates = _honest()
    updates[4] = {"w": 100 * updates[4]["w"]}
    norms = sorted(update_norm(u) for u in updates.values())
    median = (norms[2] + norms[3]) / 2
    rejected = Screening(norm_factor=3.0).reasons(updates)
    assert list(rejected) == [4]
    assert (
        rejected[4]
        == f"update norm {update_norm(updates[4]):.4g} above 3 x the round's median ({3 * median:.4g})"
    )
    assert Screening(norm_factor=200.0).reasons(updates) == {}


def test_a_sign_flipped_update_is_rejected_by_its_cosine_to_the_others_mean():
    updates = _honest()
    updates[2] = {"w": -updates[2]["w"]}
    cosines = cosines_to_mean(updates)
    others = np.mean(
        [u["w"].astype(np.float64) for node, u in updates.items() if node != 2], axis=0
    )
    expected = float(
        updates[2]["w"] @ others / (np.linalg.norm(updates[2]["w"]) * np.linalg.norm(others))
    )
    assert cosines[2] == pytest.approx(expected, rel=1e-6) and cosines[2] < -0.5
    assert all(cosine > 0.5 for node, cosine in cosines.items() if node != 2)
    rejected = Screening(min_cosine=0.0).reasons(updates)
    assert rejected == {2: f"cosine {cosines[2]:.3f} to the others' mean update, below 0"}


def test_a_sign_flip_among_nearly_orthogonal_honest_updates_is_caught_only_leaving_itself_out():
    """Ten sites whose honest updates share a weak common direction (pairwise cosine about 0.03, as updates
    over many coordinates can be): the flipped update's cosine to a mean that includes itself is about +0.2,
    which a screen at 0 keeps; to the others' mean it is about -0.07, and every honest site's about +0.06."""
    rng = np.random.default_rng(3)
    common = rng.normal(size=40_000)
    updates = {node: {"w": common / 6 + rng.normal(size=40_000)} for node in range(1, 11)}
    updates[7] = {"w": -updates[7]["w"]}
    whole = np.mean([u["w"] for u in updates.values()], axis=0)
    with_itself = float(
        updates[7]["w"] @ whole / (np.linalg.norm(updates[7]["w"]) * np.linalg.norm(whole))
    )
    cosines = cosines_to_mean(updates)
    assert with_itself > 0.15 and cosines[7] < -0.05
    assert min(cosine for node, cosine in cosines.items() if node != 7) > 0.03
    assert list(Screening(min_cosine=0.0).reasons(updates)) == [7]


def test_cosine_goes_over_arrays_of_matching_name_and_shape():
    updates = {
        1: {
            "a": np.array([1.0, 0.0]),
            "b": np.array([1.0]),
        },  # its "b" (1,): no other site's to compare
        2: {"a": np.array([1.0, 2.0]), "b": np.array([3.0, 4.0])},  # nor its "b" (2,)
        3: {"a": np.array([-2.0, 1.0])},
        4: {"c": np.array([5.0])},  # shares nothing: no cosine
    }
    cosines = cosines_to_mean(updates)
    # each against the mean of the others' "a": [-0.5, 1.5], [-0.5, 0.5], [1.0, 1.0]
    assert cosines[1] == pytest.approx(-0.5 / (1.0 * np.sqrt(2.5)))
    assert cosines[2] == pytest.approx(0.5 / (np.sqrt(5.0) * np.sqrt(0.5)))
    assert cosines[3] == pytest.approx(-1.0 / (np.sqrt(5.0) * np.sqrt(2.0)))
    assert 4 not in cosines and 4 not in Screening(min_cosine=0.9).reasons(updates)


def test_screening_needs_two_updates_and_the_run_refuses_bad_settings():
    assert Screening(norm_factor=2.0, min_cosine=0.5).reasons({1: {"w": np.ones(3)}}) == {}
    assert not Screening().enabled and Screening(min_cosine=0.0).enabled
    with pytest.raises(ConfigError, match=r"invalid --screen-norm=0.5: expected 0 \(off\) or >= 1"):
        RunConfig(screen_norm=0.5)
    with pytest.raises(ConfigError, match=r"invalid --screen-cosine=1.5"):
        RunConfig(screen_cosine=1.5)


class _Audited(AttackedGrid):
    """An attacked in-process grid that keeps an audit trail, as the coordinator's grid does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rejections: list[tuple[int, int, str]] = []

    def record_rejection(self, node_id: int, server_round: int, reason: str) -> None:
        self.rejections.append((node_id, server_round, reason))


@pytest.mark.parametrize(
    ("strategy", "attack", "screening", "reason", "rounds"),
    [
        ("fedavg", "scale", {"screen_norm": 3.0}, "update norm", 2),
        ("hydra", "scale", {"screen_norm": 3.0}, "update norm", 2),
        ("fedavg", "signflip", {"screen_cosine": 0.0}, "to the others' mean update, below 0", 1),
    ],
)
def test_screened_rounds_keep_the_attackers_out_and_audit_them(
    strategy, attack, screening, reason, rounds
):
    """A scaling attacker is cut by its norm; a sign flipper by its cosine to the others' mean (in round 1,
    where honest updates agree: later, weakly aligned honest sites can fall below 0 too)."""
    cfg = SMALL_RUN.replace(strategy=strategy, sites=5, min_sites=4, rounds=rounds, **screening)
    grid = _Audited(
        site_app.client_app, cfg.sites, cfg.to_flower(), attack=Attack(name=attack, fraction=0.2)
    )
    assert isinstance(grid, AuditsRejections)
    [attacker] = grid.attacker_nodes
    history = server_app.run_federation(grid, cfg).history
    for record in history[1:]:
        assert list(record["rejected_per_site"]) == [str(attacker)]
        assert reason in record["rejected_per_site"][str(attacker)]
        assert (record["sites_ok"], record["sites_failed"]) == (4, 1)
    assert [(node, rnd) for node, rnd, _ in grid.rejections] == [
        (attacker, r) for r in range(1, rounds + 1)
    ]
    # the model is the honest sites' alone: the same as a run where the attacker sends nothing usable
    assert np.isfinite(history[-1]["loss"]) and history[-1]["loss"] < 5


class _NanSite(InProcessGrid):
    """Node 1002 answers every train message with NaN deltas."""

    def send_and_receive(self, messages, *, timeout=None):
        for reply in super().send_and_receive(messages, timeout=timeout):
            if reply.metadata.src_node_id == 1002 and reply.metadata.message_type == "train":
                record = reply.content["arrays"]
                reply.content["arrays"] = ArrayRecord(
                    {
                        n: Array(np.full(a.shape, np.nan, a.dtype))
                        for n, a in ((n, x.numpy()) for n, x in record.items())
                    }
                )
            yield reply


def test_an_invalid_reply_is_recorded_as_rejected_with_its_reason(caplog):
    cfg = SMALL_RUN.replace(rounds=1, min_sites=2)
    history = server_app.run_federation(
        _NanSite(site_app.client_app, cfg.sites, cfg.to_flower()), cfg
    ).history
    reason = history[1]["rejected_per_site"]["1002"]
    assert reason.startswith("invalid update: array") and reason.endswith("contains NaN or Inf")
    assert history[1]["sites_ok"] == 2
    assert "site 1002 rejected: invalid update" in caplog.text
