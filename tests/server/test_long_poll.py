"""Long polls: a waiting PullMessage is answered by the message stored for its site (never by another site's),
a poll with no slot left answers "nothing yet" at once, a stored reply wakes the round driver, and stopping
the coordinator releases every waiter."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from helpers import local_coordinator

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.mailbox import Mailbox

HOUR_S = 3600.0


def test_a_waiter_wakes_on_its_own_mail_only_and_a_full_mailbox_answers_at_once():
    mailbox = Mailbox(slots=1)
    seen = mailbox.version(7)
    woken = threading.Event()
    waiter = threading.Thread(
        target=lambda: woken.set() if mailbox.wait_for_mail(7, seen, HOUR_S) else None
    )
    waiter.start()
    mailbox.post(8)  # another site's message
    assert not woken.wait(0.3)
    assert mailbox.wait_for_mail(9, mailbox.version(9), HOUR_S) is False  # the only slot is taken
    mailbox.post(7)
    waiter.join(timeout=30)
    assert woken.is_set() and mailbox.version(7) == seen + 1


def test_mail_posted_between_the_version_read_and_the_wait_is_not_missed():
    mailbox = Mailbox(slots=1)
    seen = mailbox.version(3)
    mailbox.post(3)
    assert mailbox.wait_for_mail(3, seen, HOUR_S) is True  # returns at once: the version moved


def test_close_releases_waiters_for_mail_and_for_replies():
    mailbox = Mailbox(slots=2)
    with ThreadPoolExecutor(2) as pool:
        mail = pool.submit(mailbox.wait_for_mail, 1, mailbox.version(1), HOUR_S)
        reply = pool.submit(mailbox.wait_for_reply, mailbox.replies, HOUR_S)
        mailbox.close()
        assert mail.result(timeout=30) is True and reply.result(timeout=30) is None


def test_a_long_poll_over_grpc_is_answered_by_the_message_stored_for_its_site(tmp_path):
    coordinator = local_coordinator(tmp_path)
    try:
        site, token = coordinator.store.add_site("a")
        run = coordinator.store.create_run({"rounds": 1})
        coordinator.store.set_run_status(run.id, "running")
        grid = CoordinatorGrid(coordinator.store, coordinator.blobs, coordinator.service, run.id)
        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = CoordinatorStub(channel)
            auth = (("authorization", f"Bearer {token}"),)
            idle = stub.PullMessage(pb.PullMessageRequest(), metadata=auth)
            assert (
                not idle.has_message and idle.poll_after_s > 0
            )  # no wait asked: "ask again later"
            call = stub.PullMessage.future(pb.PullMessageRequest(wait_s=HOUR_S), metadata=auth)
            message = Message(
                RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(2, dtype=np.float32))})}),
                dst_node_id=site.node_id,
                message_type="train",
            )
            message.metadata.group_id = "1"
            [message_id] = grid.push_messages([message])
            pulled = call.result(
                timeout=60
            )  # the server caps the wait at 20 s; the message answers it first
            assert pulled.has_message and pulled.envelope.message_id == message_id
    finally:
        coordinator.stop()


def test_stopping_the_coordinator_answers_a_waiting_long_poll(tmp_path):
    coordinator = local_coordinator(tmp_path)
    _, token = coordinator.store.add_site("a")
    with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
        call = CoordinatorStub(channel).PullMessage.future(
            pb.PullMessageRequest(wait_s=HOUR_S), metadata=(("authorization", f"Bearer {token}"),)
        )
        while not coordinator.service.mailbox.waiting:  # the poll is waiting at the coordinator
            threading.Event().wait(0.01)
        stopper = threading.Thread(target=coordinator.stop)
        stopper.start()
        stopper.join(timeout=15)  # well under the 20 s a poll may wait
        assert not stopper.is_alive()
        assert call.exception(timeout=5) is None and not call.result().has_message


def test_a_site_hears_only_of_its_own_runs_and_odd_waits_answer_at_once(tmp_path):
    """`last_run_id` and `wait_s` are the site's word: another run's status stays unsaid, and a negative or NaN
    wait is no long poll."""
    coordinator = local_coordinator(tmp_path)
    try:
        store = coordinator.store
        (site, token), (other, _) = store.add_site("a"), store.add_site("b")
        mine, theirs = store.create_run({"rounds": 1}), store.create_run({"rounds": 1})
        for run, node in ((mine, site.node_id), (theirs, other.node_id)):
            store.set_run_status(run.id, "running")
            message = Message(
                RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(2, dtype=np.float32))})}),
                dst_node_id=node,
                message_type="train",
            )
            message.metadata.group_id = "1"
            CoordinatorGrid(store, coordinator.blobs, coordinator.service, run.id).push_messages(
                [message]
            )
        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = CoordinatorStub(channel)
            auth = (("authorization", f"Bearer {token}"),)
            assert stub.PullMessage(
                pb.PullMessageRequest(), metadata=auth
            ).has_message  # run `mine`'s message
            for run in (mine, theirs):
                store.set_run_status(run.id, "finished")
            for wait_s in (-1.0, float("nan")):
                for run, said in ((mine, "finished"), (theirs, "")):
                    idle = stub.PullMessage(
                        pb.PullMessageRequest(last_run_id=run.id, wait_s=wait_s), metadata=auth
                    )
                    assert (
                        not idle.has_message
                        and idle.poll_after_s > 0
                        and idle.last_run_status == said
                    )
    finally:
        coordinator.stop()
