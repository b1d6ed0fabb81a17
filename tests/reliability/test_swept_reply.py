"""A reply whose message is swept (its round checkpointed and deleted) while the service checks it is not
stored: found by the hostile campaign, where a replay racing the round's sweep was stored as a new reply to
a message that no longer existed (SQLite does not enforce the foreign key) and audited as accepted twice."""

from __future__ import annotations

from sqlalchemy import delete, func, select

from hydrafl.server.store import Store
from hydrafl.server.tables import OutboundMessage, Reply


def test_a_reply_to_a_message_swept_meanwhile_is_not_stored(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'c.db'}")
    run = store.create_run({"rounds": 1})
    store.set_run_status(run.id, "running")
    for message_id in ("1-1-train-10001-0", "1-1-train-10002-0"):
        store.add_outbound(message_id, run.id, 1, int(message_id.split("-")[3]), b"envelope")
    answered = store.outbound("1-1-train-10002-0")
    assert (
        store.add_reply(answered, b"reply") is True and store.add_reply(answered, b"again") is False
    )
    outbound = store.outbound("1-1-train-10001-0")  # the service has read the message ...
    with store.session() as session, session.begin():  # ... when the round's sweep deletes it
        session.execute(
            delete(OutboundMessage).where(OutboundMessage.message_id == outbound.message_id)
        )
    assert store.add_reply(outbound, b"late") is False
    with store.session() as session:
        assert list(session.scalars(select(Reply.reply_to_message_id))) == ["1-1-train-10002-0"]
        assert session.scalar(select(func.count()).select_from(Reply)) == 1
