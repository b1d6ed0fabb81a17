"""The site policy clips and noises training updates, refuses runs it does not allow, and fails closed."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.client.policy import PolicyError, SitePolicy, load_policy


def _reply(values: dict[str, np.ndarray], message_type: str = "train") -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    request = Message(RecordDict(), dst_node_id=5, message_type=message_type)
    request.metadata.__dict__["_message_id"] = "m"
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in values.items()}),
                          "metrics": MetricRecord({"num-examples": 3})})
    return Message(content, reply_to=request)


def _norm(reply: Message) -> float:
    return float(np.sqrt(sum((a.numpy().astype(np.float64) ** 2).sum() for a in reply.content["arrays"].values())))


def test_updates_above_the_bound_are_scaled_to_it_and_smaller_ones_pass():
    big = {"a": np.full(4, 3.0, dtype=np.float32), "b": np.full(9, 4.0 / 3.0, dtype=np.float32)}  # norm sqrt(36+16)
    policy = SitePolicy(max_update_norm=2.0)
    clipped = policy.apply(_reply(big))
    assert _norm(clipped) == pytest.approx(2.0, rel=1e-6)
    np.testing.assert_allclose(clipped.content["arrays"]["a"].numpy(), 3.0 * 2.0 / np.sqrt(52), rtol=1e-6)
    small = {"a": np.full(4, 0.1, dtype=np.float32)}
    np.testing.assert_array_equal(policy.apply(_reply(small)).content["arrays"]["a"].numpy(), small["a"])
    untouched = SitePolicy(max_update_norm=0.01).apply(_reply(big, "query.init"))
    assert _norm(untouched) == pytest.approx(np.sqrt(52), rel=1e-6)


def test_noise_has_the_calibrated_scale():
    policy = SitePolicy(max_update_norm=1.0, noise_multiplier=0.5)
    noisy = policy.apply(_reply({"w": np.zeros(20_000, dtype=np.float32)})).content["arrays"]["w"].numpy()
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
    path.write_text('allowed-runs = [1, 2]\nallowed-strategies = ["fedavg"]\nmax-update-norm = 5\nnoise-multiplier = 0.1\n')
    assert load_policy(path) == SitePolicy(allowed_runs=(1, 2), allowed_strategies=("fedavg",), max_update_norm=5.0,
                                           noise_multiplier=0.1)
