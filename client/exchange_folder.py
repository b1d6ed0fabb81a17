"""Where a site's exchange goes when a model is larger than the memory it gives the exchange: a folder of
download and upload files (`--exchange-memory-mb`, `--state-dir`/exchange or a temporary folder)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from flwr.app import Message

from hydrafl.client.upload import file_backed, reply_arrays
from hydrafl.proto.envelope import array_nbytes
from hydrafl.tensor_files import MappedArray


def default_exchange_memory_bytes() -> int:
    """A quarter of this machine's physical memory: a message or reply whose arrays are larger goes through a file
    of the site's exchange folder instead of memory (`--exchange-memory-mb`). An exchange in memory holds about
    twice the model (the download, and the reply beside it), so a quarter keeps it within half the machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


EXCHANGE_FILES = ("download-*.safetensors", "upload-*.safetensors")


class ExchangeFolder:
    """The exchange's files: a message (or reply) whose arrays exceed `memory_bytes` is downloaded into
    (uploaded from) a file of `folder`, so the exchange holds a few chunks in memory whatever the model's size.
    Files a killed site left in `folder` go at start; a temporary folder, made when first needed, at `close`."""

    def __init__(self, memory_bytes: int, folder: Path | None) -> None:
        if memory_bytes < 0:
            raise ValueError(f"exchange_memory_bytes must be >= 0, got {memory_bytes}")
        self.memory_bytes = memory_bytes
        self._folder = folder
        self._made = False
        if folder is not None:
            for pattern in EXCHANGE_FILES:
                for stale in folder.glob(pattern):
                    stale.unlink(missing_ok=True)

    def path(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="hydrafl-exchange-"))
            self._made = True
        return self._folder

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path()).free

    def upload_path(self) -> Path:
        """A new upload file's path (removed after its push; one a killed site left goes at the next start)."""
        return self.path() / f"upload-{uuid.uuid4().hex}.safetensors"

    def spill(self, reply: Message) -> Path | None:
        """The file `reply`'s arrays now live in, when they exceed the bound and are not in files already, or
        are in an upload file of this folder already (a masked vector written there a window at a time): the
        caller removes it once the reply is pushed. None when the reply stays as it is."""
        held = reply_arrays(reply)
        if held and all(isinstance(array, MappedArray) for array in held):
            uploads = {Path(a.path) for a in held if isinstance(a, MappedArray)}
            mine = [p for p in uploads if p.parent == self._folder and p.name.startswith("upload-")]
            return mine[0] if len(mine) == 1 == len(uploads) else None
        if sum(array_nbytes(array) for array in held) <= self.memory_bytes:
            return None
        spilled = self.upload_path()
        del held
        file_backed(reply, spilled)
        return spilled

    def close(self) -> None:
        if self._made:
            shutil.rmtree(self.path(), ignore_errors=True)
