"""Small-cell suppression (`min-class-count`): a site refuses to train while a class of its training split has
1..k-1 records, says only the rule to the coordinator and the class and count in its own log; with enough
records it trains. Checked on a hospital site's own DICOM folder and on the simulation's sites."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from deployment import run_to_end
from dicom_files import pattern_folder
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from helpers import SMALL_RUN

from hydrafl import protocol
from hydrafl.client import site_app
from hydrafl.client.site_pipeline import answer
from hydrafl.client.site_policy import SMALL_CELL_REASON, PolicyError, SitePolicy, load_policy
from hydrafl.data import load_cohort
from hydrafl.identity import claim_server_identity
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid

CFG = SMALL_RUN.replace(sites=1, local_steps=2, batch_size=8)
NODE = 7


def test_classes_with_1_to_k_minus_1_records_are_small_cells_and_absent_classes_are_not():
    policy = SitePolicy(min_class_count=5)
    refusal = policy.small_cell_refusal({"normal": 40, "effusion": 4, "pneumonia": 0, "rare": 1})
    assert "class 'effusion' has 4, class 'rare' has 1 training record(s)" in refusal
    assert (
        "min-class-count 5" in refusal
        and "add records of that class" in refusal
        and "pneumonia" not in refusal
    )
    assert policy.small_cell_refusal({"normal": 40, "effusion": 5, "pneumonia": 0}) == ""
    assert "no class labels" in policy.small_cell_refusal(
        {}
    )  # next-token tasks: the rule cannot hold, refuse
    assert SitePolicy().small_cell_refusal({"normal": 1}) == ""


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("min-class-count = 1", "min-class-count must be an integer >= 2, got 1"),
        ("min-class-count = 2.5", "min-class-count must be an integer, got 2.5"),
        ("min-class-count = true", "min-class-count must be an integer, got True"),
    ],
)
def test_min_class_count_loads_and_is_checked(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("min-class-count = 11\n")
    assert load_policy(path) == SitePolicy(min_class_count=11)
    path.write_text(text + "\n")
    with pytest.raises(PolicyError, match=reason):
        load_policy(path)


def _message(content: RecordDict, message_type: str) -> Message:
    claim_server_identity(
        1
    )  # a message is stamped with the sender's identity, here the coordinator's
    message = Message(content, dst_node_id=NODE, message_type=message_type)
    message.metadata.__dict__["_message_id"] = message_type
    return message


def _train_on_own_data(folder: Path, policy: SitePolicy) -> Message:
    """A `hydrafl site --data FOLDER` site's answer to one train message, through the site pipeline."""
    context = Context(
        run_id=1,
        node_id=NODE,
        node_config={"data-path": str(folder)},
        state=RecordDict(),
        run_config=CFG.to_flower(),
    )
    initial = answer(site_app.client_app, _message(RecordDict(), "query.init"), context, policy)
    config = ConfigRecord({**CFG.to_flower(), protocol.SERVER_ROUND: 1})
    content = RecordDict({"arrays": initial.content["arrays"], "config": config})
    return answer(site_app.client_app, _message(content, "train"), context, policy)


def test_a_site_refuses_to_train_on_a_small_cell_of_its_dicom_studies(
    tmp_path: Path, caplog
) -> None:
    folder = pattern_folder(tmp_path / "studies", per_class=8, rare=4)
    cohort = load_cohort(
        data_path=folder, num_sites=1, seed=CFG.seed
    )  # the site's own split, as it loads it
    split = cohort.sites[0]
    rare = int((split.train_y == cohort.task.class_names.index("rare")).sum())
    assert 0 < rare <= 4 and int(split.train_y.bincount().min()) == rare

    with caplog.at_level(logging.WARNING, logger="hydrafl"):
        declined = _train_on_own_data(folder, SitePolicy(min_class_count=rare + 1))
    assert declined.has_error() and declined.error.reason == SMALL_CELL_REASON
    assert (
        "'rare'" not in declined.error.reason and str(rare) not in declined.error.reason
    )  # the cell stays here
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert (
        f"class 'rare' has {rare} training record(s), under the policy's min-class-count {rare + 1}"
        in logged
    )

    trained = _train_on_own_data(folder, SitePolicy(min_class_count=rare))
    assert not trained.has_error()
    assert isinstance(trained.content["arrays"], ArrayRecord)
    assert trained.content["metrics"][protocol.WEIGHT] == len(split.train_y)


def test_simulated_sites_apply_the_policy_to_their_own_partition() -> None:
    """Under a pathological partition sites lack whole classes: those zero counts do not refuse, a small one does."""
    cfg = SMALL_RUN.replace(partition="pathological:2")
    cohort = site_app.run_cohort(cfg)
    counts = [
        np.bincount(site.train_y.numpy(), minlength=cohort.task.num_classes)
        for site in cohort.sites
    ]
    assert all((c == 0).any() for c in counts)
    smallest = [int(c[c > 0].min()) for c in counts]
    threshold = sorted(set(smallest))[
        1
    ]  # the site(s) with a smaller class refuse, the others train
    grid = InProcessGrid(
        site_app.client_app,
        cfg.sites,
        cfg.to_flower(),
        policy=SitePolicy(min_class_count=threshold),
    )
    initial = server_app.request_initial_arrays(grid, cfg)
    config = ConfigRecord({**cfg.to_flower(), protocol.SERVER_ROUND: 1})
    messages = [
        Message(
            RecordDict({"arrays": initial, "config": config}),
            dst_node_id=node,
            message_type="train",
        )
        for node in sorted(grid.get_node_ids())
    ]

    replies = list(grid.send_and_receive(messages))

    assert [reply.has_error() for reply in replies] == [least < threshold for least in smallest]
    assert {reply.error.reason for reply in replies if reply.has_error()} == {SMALL_CELL_REASON}


@pytest.mark.slow
def test_a_hospital_site_with_a_small_cell_declines_and_the_coordinator_audits_it(
    tmp_path: Path,
) -> None:
    """Real `hydrafl site --data FOLDER --policy` processes: the site with 4 studies of a class refuses every
    round (its reason without the cell), the two others carry the run."""
    policy = tmp_path / "policy.toml"
    policy.write_text("min-class-count = 5\n")
    folders = [
        pattern_folder(tmp_path / f"site-{i}", per_class=12, seed=i, rare=4 if i == 0 else 10)
        for i in range(3)
    ]
    site_options = [("--data", str(folder), "--policy", str(policy)) for folder in folders]
    cfg = SMALL_RUN.replace(task="chest-xray", min_sites=2, rounds=2)
    store, run_id = run_to_end(tmp_path, cfg, site_options, timeout_s=240)

    run = store.run(run_id)
    assert run.status == "finished", run.detail
    assert [(r["sites_ok"], r["sites_failed"]) for r in run.history[1:]] == [(2, 1), (2, 1)]
    declines = [event.detail for event in store.audit_events("site-declined")]
    assert declines == [f"round {r} train: {SMALL_CELL_REASON}" for r in (1, 2)]
    logged = " ".join((tmp_path / "site-0.log").read_text().split())  # the console wraps long lines
    assert (
        "small cells: class 'rare' has 4 training record(s), under the policy's min-class-count 5"
        in logged
    )
