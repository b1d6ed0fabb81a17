"""A site or coordinator process keeps the memory a round freed for the next round instead of faulting it in
afresh; without the setting, glibc gives it back to the kernel."""

import json
import subprocess
import sys

import pytest

ROUND = """
import json, resource, sys
from hydrafl.malloc_tuning import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(2):  # a round: a model's tensors (64 MiB each) and chunks (1 MiB each), touched, then freed
    before = faults()
    tensors = [bytearray(64 << 20) for _ in range(4)] + [bytearray(1 << 20) for _ in range(64)]
    for block in tensors:
        block[::4096] = b"x" * len(block[::4096])
    counts.append(faults() - before)
    del tensors
print(json.dumps({"kept": kept, "faults": counts}))
"""


def one_process(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ROUND, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_the_second_round_reuses_the_first_rounds_memory_only_with_the_setting():
    pages = (4 * (64 << 20) + 64 * (1 << 20)) // 4096
    kept = one_process("keep")
    assert kept["kept"] is True
    assert kept["faults"][0] > 0.9 * pages and kept["faults"][1] < 0.05 * pages, kept
    default = one_process("default")
    assert default["faults"][1] > 0.9 * pages, (
        default
    )  # glibc's defaults: every round faults its memory in again
