"""Wake-ups instead of polling: a site's PullMessage waits here (a long poll) until a message for it is
stored, and the round driver waits until a reply is, so a round moves on as soon as its messages do.

Only part of the handler threads may be held by waiting polls (`slots`); when they are all taken a poll
returns at once and the site backs off as before, so many idle sites can never starve the calls that move
data. Versions, not flags, carry the news: a poll reads its site's version before it looks in the store, so
a message stored in between is never missed.
"""

from __future__ import annotations

import threading


class Mailbox:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._changed = threading.Condition()
        self._mail: dict[int, int] = {}
        self._replies = 0
        self._waiting = 0
        self._closed = False

    def version(self, node_id: int) -> int:
        """How many messages were posted to `node_id` so far (read before looking in the store)."""
        with self._changed:
            return self._mail.get(node_id, 0)

    def post(self, node_id: int) -> None:
        """A message for `node_id` is stored."""
        with self._changed:
            self._mail[node_id] = self._mail.get(node_id, 0) + 1
            self._changed.notify_all()

    def wait_for_mail(self, node_id: int, seen: int, timeout_s: float) -> bool:
        """Wait until a message is posted to `node_id` after version `seen`, the timeout, or close. False at
        once when every slot is taken (the caller answers "nothing yet", as without a long poll)."""
        with self._changed:
            if self._waiting >= self.slots:
                return False
            self._waiting += 1
            try:
                self._changed.wait_for(
                    lambda: self._closed or self._mail.get(node_id, 0) != seen, timeout_s
                )
            finally:
                self._waiting -= 1
            return True

    @property
    def waiting(self) -> int:
        """Long polls waiting now (each holds a handler thread)."""
        with self._changed:
            return self._waiting

    @property
    def replies(self) -> int:
        """How many replies were stored so far (read before looking in the store)."""
        with self._changed:
            return self._replies

    def reply_stored(self) -> None:
        with self._changed:
            self._replies += 1
            self._changed.notify_all()

    def wait_for_reply(self, seen: int, timeout_s: float) -> None:
        """Wait until a reply is stored after count `seen`, the timeout, or close."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._replies != seen, timeout_s)

    def close(self) -> None:
        """Release every waiter (the coordinator is stopping)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
