"""One rule for values from outside: every string a site, a network peer, an admin or a stored row controls is
cut to a bound before it reaches a log line, an audit row, a gRPC status, an error reply or a page.

A name or reason from outside is evidence worth keeping, but only a prefix of it: the coordinator keeps the first
`MAX_DETAIL_CHARS` and says how much it dropped, so one refused push costs the same few hundred bytes whatever
the site sent. Names and keys in manifests are refused past `MAX_NAME_CHARS` when they are parsed
(`hydrafl.proto.envelope`), so the messages that quote them are short to begin with.
"""

from __future__ import annotations

import logging

MAX_NAME_CHARS = 256
"""The longest tensor name, record key, metric or config key a manifest or a reply's content may hold (model
parameter names are under 200 characters)."""
MAX_DETAIL_CHARS = 500
"""A reason or detail as a status, an audit row, an error reply or a page cell keeps it."""
MAX_LOG_CHARS = 2_000
"""A log line's message, whatever it quotes (tracebacks are the coordinator's own and not cut)."""
QUOTED_CHARS = 60
"""A name quoted inside a message that refuses it: enough to recognise it."""


def bounded(text: object, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` as a string of at most `limit` characters plus a marker that says how many were cut."""
    text = str(text)
    return text if len(text) <= limit else marked(text[:limit], len(text) - limit)


def marked(head: str, dropped: int) -> str:
    """`head`, the part kept of a longer text, followed by the marker that says `dropped` characters were cut
    (for a prefix read from a database, where the rest was never loaded)."""
    return f"{head}...[cut, {dropped} more chars]" if dropped > 0 else head


def quoted(name: str, limit: int = QUOTED_CHARS) -> str:
    """A name from outside as a message quotes it: repr() of its first `limit` characters, then the marker."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}...[cut, {len(name) - limit} more chars]"


class BoundedRecords(logging.Filter):
    """Cuts every record's message to `limit` characters before any handler formats it: the log sink's share of
    the rule, for a value some caller forgot to bound (and for other libraries' records)."""

    def __init__(self, limit: int = MAX_LOG_CHARS) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > self.limit:
            record.msg, record.args = bounded(message, self.limit), None
        return True
