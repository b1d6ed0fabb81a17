"""A site's failure for lack of disk space is named as such, without the path, whether the error reaches the
agent itself or only as a failed training process."""

from __future__ import annotations

import errno
import tempfile

from hydrafl.client.error_replies import disk_full


class ChildFailed(RuntimeError):
    """Stands for torch's ChildFailedError: the child's OSError does not travel with it."""


def test_an_oserror_of_a_full_disk_anywhere_in_the_chain_is_disk_full():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/secret/tmp/rank0.pt")
        except OSError as error:
            raise RuntimeError("training failed") from error
    except RuntimeError as error:
        assert disk_full(error, 1) == (
            "ENOSPC",
            "No space left on device writing /secret/tmp/rank0.pt",
        )


def test_a_failed_child_is_disk_full_when_the_temporary_directory_refuses_a_write(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    code, detail = disk_full(ChildFailed("2 training processes failed"), 300_000)
    assert code == "EFBIG" and detail.startswith("File too large: cannot write 0.3 MB to ")


def test_other_failures_are_not_disk_full(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert disk_full(ChildFailed("a rank crashed"), 1 << 20) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied"), 1) is None
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
