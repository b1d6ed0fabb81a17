"""Secure aggregation in the round driver and the site pipeline, on the in-process grid with the real hydrafl
app: the model equals the plain run's within the quantisation bound, the coordinator holds only masked vectors,
a site that fails after sharing keys (or is routed an altered share) is recovered, too few sites halt the round,
and strategies that need one site's update refuse."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord
from helpers import SMALL_RUN, TIERED_RUN, site_app_failing

from hydrafl import protocol
from hydrafl.benchmarks._secagg_poisoner import ModifiedSitesGrid
from hydrafl.client import site_app
from hydrafl.config import SECAGG_ROUND_TIMEOUT_S
from hydrafl.secagg import SecAggParams, metric_bound, quantisation_bound, wire
from hydrafl.secagg.crypto import new_private_key, public_key
from hydrafl.secagg.quantize import METRIC_SLOTS
from hydrafl.secagg.shamir import split
from hydrafl.server import server_app
from hydrafl.server.aggregation.driver import RoundFailed
from hydrafl.server.aggregation.secure_round import METRIC_RANGE, TRAIN_METRICS
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid, _wire_copy
from hydrafl.simulation_config import SimulationConfig
from hydrafl.updates import records
from hydrafl.validation import ConfigError

ONE_ROUND = SMALL_RUN.replace(rounds=1, run_dir="")
MIN_WEIGHT = 3 * 10
"""Each small site trains on more than 10 examples: the mean's quantisation error is at most bound / this."""


class _RecordingGrid(InProcessGrid):
    """The in-process grid, keeping every train reply the coordinator receives."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.train_replies: list[Message] = []
        self.evaluate_replies: list[Message] = []

    def _deliver(self, message: Message) -> Message:
        reply = super()._deliver(message)
        if (
            message.metadata.message_type == "train"
        ):  # copies: the driver turns a plain reply's delta into weights
            self.train_replies.append(_wire_copy(reply))
        elif message.metadata.message_type == "evaluate":
            self.evaluate_replies.append(_wire_copy(reply))
        return reply


def _run(cfg, client_app=site_app.client_app):
    grid = _RecordingGrid(client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg), grid


def _max_difference(a: ArrayRecord, b: ArrayRecord) -> float:
    return max(float(np.abs(a[name].numpy() - b[name].numpy()).max()) for name in a)


@pytest.mark.parametrize("strategy", ["fedavg", "diloco"])
def test_a_secure_round_gives_the_plain_model_within_the_quantisation_bound(strategy):
    cfg = ONE_ROUND.replace(strategy=strategy)
    plain, _ = _run(cfg)
    secure, grid = _run(cfg.replace(secagg=True))
    difference = _max_difference(plain.arrays, secure.arrays)
    step = (
        0.7 if strategy == "diloco" else 1.0
    )  # DiLoCo moves by outer_lr x the mean delta (no momentum yet)
    assert 0 < difference <= step * quantisation_bound(3, SecAggParams()) / MIN_WEIGHT
    [record] = secure.history[1:]
    assert (
        record["sites_ok"] == 3 and record["secagg_bytes"] > 3 * 2 * 32 and record["secagg_s"] > 0
    )
    assert plain.history[1]["secagg_bytes"] == 0
    for reply in grid.train_replies:  # all the coordinator ever held of one site's update
        [arrays] = records(reply.content, ArrayRecord)
        assert (
            list(arrays) == [protocol.SECAGG_MASKED]
            and arrays[protocol.SECAGG_MASKED].dtype == "uint32"
        )
        assert len(reply.content) == 1  # no MetricRecord, no data hash: nothing else in the clear


def _clear_values(reply: Message) -> list:
    """Everything a reply carries in the clear outside its masked vector."""
    return [
        (key, dict(record))
        for key, record in reply.content.items()
        if not (isinstance(record, ArrayRecord) and list(record) == [protocol.SECAGG_MASKED])
    ]


def test_secure_replies_carry_nothing_per_site_in_the_clear_and_the_round_reports_the_plain_weighted_means():
    """Train and evaluate replies under --secagg are one masked vector each; the round's train loss (weighted by
    examples, as FedAvg weighs it) and its evaluation loss and accuracy are decoded from the masked sums and
    equal the plain run's within the quantisation bound of `metric_bound`."""
    cfg = ONE_ROUND
    plain, plain_grid = _run(cfg)
    secure, grid = _run(cfg.replace(secagg=True))
    assert len(grid.train_replies) == 3 and len(grid.evaluate_replies) == 6  # round 0 and round 1
    for reply in grid.train_replies + grid.evaluate_replies:
        assert _clear_values(reply) == []
        [arrays] = records(reply.content, ArrayRecord)
        assert arrays[protocol.SECAGG_MASKED].dtype == "uint32"
    # the plain run's per-site values, which the secure run never sent: the means must match within the bound
    train_weights = [
        records(r.content, MetricRecord)[0][protocol.WEIGHT] for r in plain_grid.train_replies
    ]
    assert (
        protocol.WEIGHT in records(plain_grid.train_replies[0].content, MetricRecord)[0]
    )  # the plain run sends it
    bound = metric_bound(3, METRIC_RANGE, SecAggParams(), sum(train_weights))
    assert abs(secure.history[1]["train_loss"] - plain.history[1]["train_loss"]) <= bound
    test_weight = sum(
        records(r.content, MetricRecord)[0][protocol.WEIGHT]
        for r in plain_grid.evaluate_replies[:3]
    )
    assert abs(secure.history[0]["loss"] - plain.history[0]["loss"]) <= metric_bound(
        3, METRIC_RANGE, SecAggParams(), test_weight
    )
    assert abs(secure.history[0]["accuracy"] - plain.history[0]["accuracy"]) <= metric_bound(
        3, 1.0, SecAggParams(), test_weight
    )
    assert (
        secure.history[0]["loss"] != plain.history[0]["loss"]
    )  # decoded, not copied from a clear value
    assert abs(secure.history[1]["accuracy"] - plain.history[1]["accuracy"]) <= 0.01
    assert secure.history[0]["secagg_bytes"] > 0  # the evaluation's own protocol round


def test_the_honest_site_bound_clips_each_update_before_masking_and_a_modified_site_escapes_it():
    """--secagg-clip C: the secure mean is the weighted mean of the updates each clipped to L2 norm C (within
    the quantisation bound); a site that skips the bound (a modified site) lands in the sum unclipped."""
    plain, plain_grid = _run(ONE_ROUND)
    deltas, weights = [], []
    for reply in plain_grid.train_replies:
        [arrays], [metrics] = (
            records(reply.content, ArrayRecord),
            records(reply.content, MetricRecord),
        )
        deltas.append(
            np.concatenate([arrays[n].numpy().astype(np.float64).ravel() for n in arrays])
        )
        weights.append(metrics[protocol.WEIGHT])
    names = list(records(plain_grid.train_replies[0].content, ArrayRecord)[0])
    norms = [float(np.linalg.norm(d)) for d in deltas]
    clip = 0.5 * min(norms)  # every honest update is above it
    mean = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
    clipped = sum(w * d * clip / n for w, d, n in zip(weights, deltas, norms, strict=True)) / sum(
        weights
    )

    def flat(arrays: ArrayRecord) -> np.ndarray:
        return np.concatenate([arrays[n].numpy().astype(np.float64).ravel() for n in names])

    start = flat(plain.arrays) + mean  # FedAvg steps by the mean delta (start - end)
    bounded, _ = _run(ONE_ROUND.replace(secagg=True, secagg_clip=clip))
    step = start - flat(bounded.arrays)
    assert np.abs(step - clipped).max() <= quantisation_bound(3, SecAggParams()) / MIN_WEIGHT + 1e-6
    assert np.linalg.norm(step) <= clip * 1.001 < np.linalg.norm(mean)

    grid = ModifiedSitesGrid(
        site_app.client_app, 3, ONE_ROUND.to_flower(), modified={FIRST_NODE_ID}
    )
    escaped = server_app.run_federation(grid, ONE_ROUND.replace(secagg=True, secagg_clip=clip))
    step = start - flat(escaped.arrays)
    unbounded = weights[0] * deltas[0] + sum(
        w * d * clip / n for w, d, n in zip(weights[1:], deltas[1:], norms[1:], strict=True)
    )
    assert (
        np.abs(step - unbounded / sum(weights)).max()
        <= quantisation_bound(3, SecAggParams()) / MIN_WEIGHT + 1e-6
    )


def test_a_site_failing_after_sharing_keys_is_recovered_exactly():
    cfg = ONE_ROUND.replace(min_sites=2)
    app = site_app_failing({1})
    plain, _ = _run(cfg, app)
    secure, _ = _run(cfg.replace(secagg=True), app)
    assert secure.history[1]["sites_ok"] == 2 and secure.history[1]["sites_failed"] == 1
    assert _max_difference(plain.arrays, secure.arrays) <= quantisation_bound(2, SecAggParams()) / (
        2 * 10
    )


def test_a_secure_run_needs_only_the_threshold_by_default_and_has_a_deadline():
    """Without --min-sites a secure round succeeds with the protocol's threshold of survivors (the others' masks
    are rebuilt from shares), and waits at most SECAGG_ROUND_TIMEOUT_S without --round-timeout-s."""
    cfg = ONE_ROUND.replace(secagg=True)
    assert (cfg.required_sites, cfg.available_sites, cfg.round_deadline_s) == (
        2,
        3,
        SECAGG_ROUND_TIMEOUT_S,
    )
    assert (ONE_ROUND.required_sites, ONE_ROUND.round_deadline_s) == (3, None)
    assert cfg.replace(round_timeout_s=30.0).round_deadline_s == 30.0
    secure, _ = _run(cfg, site_app_failing({1}))
    assert secure.history[1]["sites_ok"] == 2 and secure.history[1]["sites_failed"] == 1
    with pytest.raises(RoundFailed, match="only 1 of 3 sites"):
        _run(cfg, site_app_failing({0, 1}))


class _TamperingGrid(InProcessGrid):
    """Flips one bit of the first share routed to the second site in its train message."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.errors: dict[int, str] = {}

    def _deliver(self, message: Message) -> Message:
        if (
            message.metadata.message_type == "train"
            and message.metadata.dst_node_id == FIRST_NODE_ID + 1
        ):
            sealed = wire.parse_sealed(message.content[protocol.SECAGG_RECORD])
            first = min(sealed)
            sealed[first] = sealed[first][:-1] + bytes([sealed[first][-1] ^ 1])
            message.content[protocol.SECAGG_RECORD] = ConfigRecord(wire.sealed_record(sealed))
        reply = super()._deliver(message)
        if reply.has_error():
            self.errors[message.metadata.dst_node_id] = reply.error.reason
        return reply


def test_an_altered_share_fails_only_its_site_and_the_round_goes_on():
    cfg = ONE_ROUND.replace(min_sites=2, secagg=True)
    grid = _TamperingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    secure = server_app.run_federation(grid, cfg)
    assert (
        list(grid.errors) == [FIRST_NODE_ID + 1]
        and "failed authentication" in grid.errors[FIRST_NODE_ID + 1]
    )
    assert secure.history[1]["sites_ok"] == 2
    plain, _ = _run(
        cfg.replace(secagg=False), site_app_failing({1})
    )  # the same round without that site
    assert _max_difference(plain.arrays, secure.arrays) <= quantisation_bound(2, SecAggParams()) / (
        2 * 10
    )


class _ShortKeyGrid(InProcessGrid):
    """The first site answers the keys query with a truncated public key."""

    def _deliver(self, message: Message) -> Message:
        reply = super()._deliver(message)
        if (
            message.metadata.message_type == protocol.QUERY_SECAGG_KEYS
            and message.metadata.dst_node_id == FIRST_NODE_ID
        ):
            record = reply.content[protocol.SECAGG_RECORD]
            reply.content[protocol.SECAGG_RECORD] = ConfigRecord(
                {**record, "share-key": record["share-key"][:5]}
            )
        return reply


def test_a_malformed_public_key_leaves_its_site_out_and_the_round_goes_on(caplog):
    cfg = ONE_ROUND.replace(min_sites=2, secagg=True)
    result = server_app.run_federation(
        _ShortKeyGrid(site_app.client_app, cfg.sites, cfg.to_flower()), cfg
    )
    assert result.history[1]["sites_ok"] == 2
    assert (
        f"site {FIRST_NODE_ID} failed query.secagg_keys" in caplog.text
        and "malformed key material" in caplog.text
    )


class _LyingGrid(InProcessGrid):
    """A coordinator that lies: it swaps its own keys in for the second site's in every share-keys request
    (`swap_keys`), and the second site reveals a crafted share of the first site's seed (`craft_share`), with
    the third site silent while unmasking (`silence_third`)."""

    def __init__(
        self, *args, swap_keys=False, craft_share=False, silence_third=False, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.swap_keys, self.craft_share, self.silence_third = swap_keys, craft_share, silence_third
        self.errors: dict[int, str] = {}

    def _deliver(self, message: Message) -> Message:
        kind, node = message.metadata.message_type, message.metadata.dst_node_id
        if kind == protocol.QUERY_SECAGG_SHARES and self.swap_keys:
            me, keys = wire.parse_shares_request(message.content[protocol.SECAGG_RECORD])
            own = public_key(new_private_key())
            keys[FIRST_NODE_ID + 1] = replace(keys[FIRST_NODE_ID + 1], share_key=own, mask_key=own)
            message.content[protocol.SECAGG_RECORD] = ConfigRecord(wire.shares_request(me, keys))
        reply = super()._deliver(message)
        if (
            kind == protocol.QUERY_SECAGG_UNMASK
            and node == FIRST_NODE_ID + 2
            and self.silence_third
        ):
            reply = Message(Error(0, "site lost power"), reply_to=message)
        if kind == protocol.QUERY_SECAGG_UNMASK and node == FIRST_NODE_ID + 1 and self.craft_share:
            revealed = wire.parse_unmask_reply(reply.content[protocol.SECAGG_RECORD])
            revealed[FIRST_NODE_ID] = split(os.urandom(32), [2, 3], 2)[
                2
            ]  # in range, of another secret
            reply.content[protocol.SECAGG_RECORD] = ConfigRecord(wire.unmask_reply(revealed))
        if reply.has_error():
            self.errors[node] = reply.error.reason
        return reply


def test_keys_the_coordinator_swaps_in_are_refused_and_the_round_applies_nothing(tmp_path):
    cfg = ONE_ROUND.replace(min_sites=1, secagg=True, run_dir=str(tmp_path))
    grid = _LyingGrid(site_app.client_app, cfg.sites, cfg.to_flower(), swap_keys=True)
    with pytest.raises(
        RoundFailed, match=r"round 1: secure aggregation: .*only 0 of 3 sites sent masked vectors"
    ):
        server_app.run_federation(grid, cfg)
    assert (
        "the round keys of site 1002: the signature does not verify" in grid.errors[FIRST_NODE_ID]
    )
    assert "does not hold this site's own public keys" in grid.errors[FIRST_NODE_ID + 1]
    assert not (tmp_path / "history.json").read_text().count('"round": 1')


def test_a_crafted_share_with_a_spare_is_outvoted_its_sender_named_and_the_sum_right(caplog):
    cfg = ONE_ROUND.replace(secagg=True)
    plain, _ = _run(cfg.replace(secagg=False))
    secure = server_app.run_federation(
        _LyingGrid(site_app.client_app, cfg.sites, cfg.to_flower(), craft_share=True), cfg
    )
    assert (
        f"site {FIRST_NODE_ID + 1} revealed a corrupt share of site {FIRST_NODE_ID}'s secret"
        in caplog.text
    )
    assert secure.history[1]["sites_ok"] == 3
    assert (
        _max_difference(plain.arrays, secure.arrays)
        <= quantisation_bound(3, SecAggParams()) / MIN_WEIGHT
    )


def test_a_crafted_share_at_exactly_the_threshold_halts_the_round_and_applies_nothing(tmp_path):
    cfg = ONE_ROUND.replace(min_sites=1, secagg=True, run_dir=str(tmp_path))
    grid = _LyingGrid(
        site_app.client_app, cfg.sites, cfg.to_flower(), craft_share=True, silence_third=True
    )
    with pytest.raises(
        RoundFailed, match=f"site {FIRST_NODE_ID}'s secret: no 2 of the 2 shares .*applies nothing"
    ):
        server_app.run_federation(grid, cfg)
    assert not (tmp_path / "history.json").read_text().count('"round": 1')


def test_fewer_sites_than_the_threshold_halt_the_round_and_apply_nothing(tmp_path):
    cfg = ONE_ROUND.replace(min_sites=1, secagg=True, run_dir=str(tmp_path))
    with pytest.raises(
        RoundFailed,
        match=r"round 1: secure aggregation: .*only 1 of 3 sites .*threshold is 2.*halts",
    ):
        _run(cfg, site_app_failing({0, 1}))
    assert not (tmp_path / "history.json").read_text().count('"round": 1')


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "outer_lr"), [("hydra", 0.7), ("heterofl", 1.0), ("fedit", 1.0)]
)
def test_a_subnetwork_strategy_sums_its_sites_slices_securely(strategy, outer_lr):
    """Sites train slices (FedIT: their LoRA rank's components): each uploads full-shape masked vectors with
    per-coordinate weights (HeteroFL weighs every site 1, Hydra and FedIT by their examples); the model is the
    plain run's within the bound (both planned as a private run plans: from the weights)."""
    lora = {"lora_rank": 8} if strategy == "fedit" else {}
    cfg = TIERED_RUN.replace(
        strategy=strategy,
        rounds=1,
        run_dir="",
        layer_score="magnitude",
        head_score="magnitude",
        **lora,
    )
    plain, _ = _run(cfg)
    secure, grid = _run(cfg.replace(secagg=True))
    per_site = SecAggParams(max_weight=1) if strategy == "heterofl" else SecAggParams()
    minimum_weight = 1 if strategy == "heterofl" else 10
    assert plain.arrays.keys() == secure.arrays.keys()
    assert (
        0
        < _max_difference(plain.arrays, secure.arrays)
        <= outer_lr * quantisation_bound(3, per_site) / minimum_weight
    )
    size = sum(int(np.prod(a.shape)) for a in plain.arrays.values())
    for reply in (
        grid.train_replies
    ):  # full shapes and a weight per coordinate, whatever slice a site trained
        [arrays] = records(reply.content, ArrayRecord)
        assert tuple(arrays[protocol.SECAGG_MASKED].shape) == (
            2 * size + METRIC_SLOTS * len(TRAIN_METRICS),
        )


@pytest.mark.parametrize(
    "strategy", ["fedmedian", "fedtrimmedavg", "krum", "flora", "hetlora", "flexlora"]
)
def test_strategies_that_need_each_sites_update_refuse_secure_aggregation(strategy):
    with pytest.raises(
        ConfigError, match=f"invalid --secagg=True: expected off for strategy '{strategy}'"
    ):
        SMALL_RUN.replace(strategy=strategy, secagg=True, lora_rank=4)


@pytest.mark.parametrize(
    ("key", "value"), [("screen_norm", 3.0), ("diagnostics", True), ("robust_rule", "median")]
)
def test_what_needs_one_sites_update_at_the_coordinator_refuses_secure_aggregation(key, value):
    with pytest.raises(ConfigError, match=f"invalid --{key.replace('_', '-')}=.*with --secagg"):
        TIERED_RUN.replace(secagg=True, **{key: value})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"attack": "signflip", "attackers": 0.3},
            "invalid --attack='signflip': expected empty with --secagg",
        ),
    ],
)
def test_simulations_the_sites_cannot_mask_in_refuse_secure_aggregation(changes, message):
    with pytest.raises(ConfigError, match=message):
        SimulationConfig(run=SMALL_RUN.replace(secagg=True), strategies=("fedavg",), **changes)


def test_a_site_weighing_more_than_secagg_max_weight_fails_naming_the_key_and_a_larger_bound_admits_it(
    caplog,
):
    cfg = ONE_ROUND.replace(secagg=True, secagg_max_weight=10, min_sites=1)
    with pytest.raises(RoundFailed, match="only 0 of 3 sites"):
        _run(cfg)
    assert "secagg-max-weight" in caplog.text
    result, _ = _run(cfg.replace(secagg_max_weight=10_000))
    assert result.history[1]["sites_ok"] == 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"secagg_clip": 1.0}, "invalid --secagg-clip=1.0: expected 0 without --secagg"),
        (
            {"secagg": True, "secagg_clip": 1.0, "dp_clip": 1.0},
            "invalid --secagg-clip=1.0: expected .*0 with --dp-clip",
        ),
        (
            {"secagg": True, "secagg_clip": -1.0},
            "invalid --secagg-clip=-1.0: expected a number >= 0",
        ),
    ],
)
def test_the_honest_site_bound_needs_secure_aggregation_and_gives_way_to_dp_clip(changes, message):
    with pytest.raises(ConfigError, match=message):
        ONE_ROUND.replace(**changes)
