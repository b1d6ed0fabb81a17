"""The site policy clips and noises training updates, refuses runs it does not allow, and fails closed."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl import protocol
from hydrafl.client.site_policy import PRIVACY_STATE, PolicyError, SitePolicy, load_policy


def _reply(values: dict[str, np.ndarray], message_type: str = "train") -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    request = Message(RecordDict(), dst_node_id=5, message_type=message_type)
    request.metadata.__dict__["_message_id"] = "m"
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in values.items()}),
            "metrics": MetricRecord({"num-examples": 3}),
        }
    )
    return Message(content, reply_to=request)


def _norm(reply: Message) -> float:
    return float(
        np.sqrt(
            sum((a.numpy().astype(np.float64) ** 2).sum() for a in reply.content["arrays"].values())
        )
    )


def test_updates_above_the_bound_are_scaled_to_it_and_smaller_ones_pass():
    big = {
        "a": np.full(4, 3.0, dtype=np.float32),
        "b": np.full(9, 4.0 / 3.0, dtype=np.float32),
    }  # norm sqrt(36+16)
    policy = SitePolicy(max_update_norm=2.0)
    clipped = policy.apply(_reply(big))
    assert _norm(clipped) == pytest.approx(2.0, rel=1e-6)
    np.testing.assert_allclose(
        clipped.content["arrays"]["a"].numpy(), 3.0 * 2.0 / np.sqrt(52), rtol=1e-6
    )
    small = {"a": np.full(4, 0.1, dtype=np.float32)}
    np.testing.assert_array_equal(
        policy.apply(_reply(small)).content["arrays"]["a"].numpy(), small["a"]
    )
    untouched = SitePolicy(max_update_norm=0.01).apply(_reply(big, "query.init"))
    assert _norm(untouched) == pytest.approx(np.sqrt(52), rel=1e-6)


def test_noise_has_the_calibrated_scale():
    policy = SitePolicy(max_update_norm=1.0, noise_multiplier=0.5)
    noisy = (
        policy.apply(_reply({"w": np.zeros(20_000, dtype=np.float32)}))
        .content["arrays"]["w"]
        .numpy()
    )
    assert noisy.std() == pytest.approx(0.5, rel=0.05) and abs(noisy.mean()) < 0.02


def test_run_and_strategy_allow_lists():
    policy = SitePolicy(allowed_runs=(3,), allowed_strategies=("fedavg",))
    assert policy.refusal(3, "fedavg") == ""
    assert "run 4" in policy.refusal(4, "fedavg")
    assert "'diloco'" in policy.refusal(3, "diloco")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("max-update-norm = -1", "positive"),
        ("noise-multiplier = 1.0", "needs max-update-norm"),
        ("allowed-runs = [1, 'x']", "list of int"),
        ("clip = 3", "unknown key 'clip'"),
        ("max-update-norm = = 2", "not valid TOML"),
        ("allowed-apps = ['abc']", "'abc' is not a SHA-256 digest"),
        ("allowed-apps = 'f' ", "list of str"),
    ],
)
def test_invalid_policy_files_fail_closed(tmp_path, text, reason):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=reason):
        load_policy(path)
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "missing.toml")


def test_a_valid_policy_file_loads(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(
        'allowed-runs = [1, 2]\nallowed-strategies = ["fedavg"]\nmax-update-norm = 5\nnoise-multiplier = 0.1\n'
        f'allowed-apps = ["{"ab" * 32}"]\n'
    )
    assert load_policy(path) == SitePolicy(
        allowed_runs=(1, 2),
        allowed_strategies=("fedavg",),
        max_update_norm=5.0,
        noise_multiplier=0.1,
        allowed_apps=("ab" * 32,),
    )


def _train_message(run_epsilon: float | None) -> Message:
    config = ConfigRecord({} if run_epsilon is None else {protocol.RUN_EPSILON: run_epsilon})
    message = Message(RecordDict({"config": config}), dst_node_id=5, message_type="train")
    message.metadata.__dict__["_message_id"] = "m"
    return message


def _context() -> Context:
    return Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})


def test_a_site_refuses_a_round_that_would_take_the_run_over_its_budget():
    policy = SitePolicy(max_epsilon=4.0)
    assert policy.budget_refusal(_train_message(3.9), _context()) == ""
    assert policy.budget_refusal(_train_message(4.0), _context()) == ""
    refusal = policy.budget_refusal(_train_message(4.2), _context())
    assert (
        refusal
        == "privacy budget: this round would bring the site's epsilon to 4.2, over its max-epsilon 4"
    )
    assert "infinite" in policy.budget_refusal(
        _train_message(None), _context()
    )  # no central DP: fail closed
    assert "infinite" in policy.budget_refusal(_train_message(float("nan")), _context())
    assert (
        SitePolicy().budget_refusal(_train_message(None), _context()) == ""
    )  # no budget, no check
    declined = policy.decline(_train_message(4.2), refusal)
    assert declined.has_error() and declined.error.reason == refusal


def test_local_noise_is_accounted_per_participation_and_reported_in_the_reply():
    policy = SitePolicy(max_update_norm=1.0, noise_multiplier=2.0, max_epsilon=3.0)
    context = _context()
    spent = []
    for _ in range(3):
        reply = policy.release(_reply({"w": np.zeros(8, dtype=np.float32)}), context)
        spent.append(reply.content["privacy"][protocol.LOCAL_EPSILON])
    reference = (
        RdpAccountant()
    )  # each reply: a Gaussian of sensitivity 2C, so noise multiplier z / 2
    reference.compose(dp_accounting.GaussianDpEvent(1.0), 3)
    assert spent[-1] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
    assert spent == sorted(spent) and context.state[PRIVACY_STATE]["participations"] == 3
    # without central DP the site's own epsilon decides: the round that would pass max-epsilon is refused
    rounds = next(k for k in range(1, 100) if policy.local_epsilon(k) > 3.0)
    context.state[PRIVACY_STATE] = ConfigRecord({"participations": rounds - 2})
    assert policy.budget_refusal(_train_message(None), context) == ""
    context.state[PRIVACY_STATE] = ConfigRecord({"participations": rounds - 1})
    assert "over its max-epsilon 3" in policy.budget_refusal(_train_message(None), context)
    assert (
        policy.budget_refusal(_train_message(0.5), context) == ""
    )  # the run's central spending is smaller


def test_budget_keys_load_and_are_checked(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text("max-update-norm = 1\nnoise-multiplier = 1.0\nmax-epsilon = 8\ndelta = 1e-6\n")
    assert load_policy(path) == SitePolicy(
        max_update_norm=1.0, noise_multiplier=1.0, max_epsilon=8.0, delta=1e-6
    )
    path.write_text("max-epsilon = 0\n")
    with pytest.raises(PolicyError, match="max-epsilon must be a positive number"):
        load_policy(path)
