"""The ledger records both accountants' epsilon per round, sends the Renyi DP one to the sites, and a resumed
run's ledger, rebuilt from the stored history, goes on with the same numbers."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl import protocol
from hydrafl.privacy.accountant import RoundSample, epsilon, exact_epsilon
from hydrafl.privacy.ledger import PrivacyLedger
from hydrafl.rounds import RoundRecord

STRATEGY = SimpleNamespace(central_dp=SimpleNamespace(clip=1.0))
SAMPLED = [4, 2, 3, 4]
"""Sites sampled in each round, out of 4."""


def _messages(count: int) -> list[Message]:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
        1,
        SUPERLINK_NODE_ID,
        1,
    )  # the driver's
    return [
        Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
        for node in range(1, count + 1)
    ]


def _run_round(
    ledger: PrivacyLedger, number: int, sampled: int
) -> tuple[RoundRecord, list[Message]]:
    messages = _messages(sampled)
    ledger.open_round(messages, 4, STRATEGY)
    record = RoundRecord(round=number, sites_ok=sampled)
    ledger.close_round(record)
    return record, messages


def test_each_round_records_both_epsilons_and_a_resumed_ledger_gives_the_same():
    ledger = PrivacyLedger(1.1, 1e-5)
    history = []
    for number, sampled in enumerate(SAMPLED, start=1):
        record, messages = _run_round(ledger, number, sampled)
        rounds = [RoundSample(m, 4) for m in SAMPLED[:number]]
        assert record.dp_epsilon == pytest.approx(epsilon(1.1, rounds, delta=1e-5), rel=1e-12)
        assert record.dp_epsilon_exact == pytest.approx(
            exact_epsilon(1.1, rounds, delta=1e-5), rel=1e-12
        )
        assert all(
            message.content["config"][protocol.RUN_EPSILON] == record.dp_epsilon
            for message in messages
        )
        history.append(asdict(record))

    resumed = PrivacyLedger(1.1, 1e-5)
    resumed.restore(history[:2])
    replayed = [
        _run_round(resumed, number, sampled)[0]
        for number, sampled in enumerate(SAMPLED[2:], start=3)
    ]
    assert [(r.dp_epsilon, r.dp_epsilon_exact) for r in replayed] == [
        (entry["dp_epsilon"], entry["dp_epsilon_exact"]) for entry in history[2:]
    ]
    assert (
        history[0]["dp_epsilon_exact"] <= history[0]["dp_epsilon"]
    )  # all four sites: PLD is the tight one


def test_a_stored_history_from_before_the_exact_accountant_still_reads():
    entry = asdict(RoundRecord(round=1, sites_ok=4, dp_epsilon=2.0, dp_sites_available=4))
    del entry["dp_epsilon_exact"]
    assert RoundRecord(**entry).dp_epsilon_exact is None
    ledger = PrivacyLedger(1.1, 1e-5)
    ledger.restore([entry])
    assert ledger.samples == [RoundSample(4, 4)]
