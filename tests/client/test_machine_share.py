"""A site's torch threads are its share of the machine's cores among the hydrafl sites running on it: counted
from the live registrations (real processes holding their lock), a dead site's left behind, `--threads` fixed."""

from __future__ import annotations

import subprocess
import sys
import time

from hydrafl.client.machine_share import MachineShare, machine_cores

HOLDER = """
import sys, time
from pathlib import Path
from hydrafl.client.machine_share import MachineShare
share = MachineShare(Path(sys.argv[1]))
print("registered", flush=True)
time.sleep(600)
"""


def _site_process(folder) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "registered"
    return process


def test_each_site_takes_its_share_and_a_dead_sites_share_comes_back(tmp_path):
    share = MachineShare(tmp_path)
    assert share.live_sites() == 1 and share.threads() == machine_cores()
    others = [_site_process(tmp_path) for _ in range(2)]
    try:
        assert share.live_sites() == 3
        assert share.threads() == max(1, machine_cores() // 3)
        assert share.threads(processes=2) == max(1, machine_cores() // 6)
        others[0].kill()  # kill -9: its lock goes with it, its file stays behind
        others[0].wait()
        assert share.live_sites() == 2
        assert len(list(tmp_path.glob("*.site"))) == 2  # the dead site's file is gone
    finally:
        for process in others:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 5
    while share.live_sites() != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert share.threads() == machine_cores()
    share.release()
    assert list(tmp_path.glob("*.site")) == []


def test_threads_set_by_the_operator_are_kept_and_register_nothing(tmp_path):
    share = MachineShare(tmp_path / "sites", fixed=3)
    assert share.threads() == 3 and share.threads(processes=2) == 1
    assert not (tmp_path / "sites").exists()
