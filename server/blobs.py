"""Content-addressed array chunks on disk: `<root>/<first two hex digits>/<sha256>`.

A chunk is verified against its name when it is written, written atomically, and never rewritten, so
re-sending a chunk (a resumed upload, a retry) is free and cannot corrupt what is stored.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from hydrafl.proto.envelope import EnvelopeError, sha256


class BlobStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise EnvelopeError(f"{digest[:80]!r} is not a SHA-256 hex digest")
        return self.root / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self._path(digest).exists()

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [digest for digest in digests if not self.has(digest)]

    def put(self, digest: str, data: bytes) -> bool:
        """Store a chunk; False when it was already there. A chunk that does not hash to its name is refused."""
        path = self._path(digest)
        if path.exists():
            return False
        if sha256(data) != digest:
            raise EnvelopeError(f"chunk {digest[:12]} fails its SHA-256 check ({len(data)} bytes received)")
        path.parent.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
        return True

    def size(self, digest: str) -> int:
        return self._path(digest).stat().st_size

    def get(self, digest: str) -> bytes:
        path = self._path(digest)
        if not path.exists():
            raise KeyError(f"chunk {digest[:12]} is not stored")
        return path.read_bytes()
