"""The layer-streaming benchmark's quick mode end to end: every configuration trains to the same loss, and the
window's peak grows with the window while the streamed footprint stays under the in-memory one."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_layer_streaming_quick(tmp_path):
    result = run_quick("layer_streaming", tmp_path, timeout_s=400)
    assert result["quick"] is True
    runs = result["runs"]
    assert [(run["window"], run["offload"]) for run in runs] == [
        (0, "auto"),
        (1, "auto"),
        (2, "auto"),
        (4, "auto"),
        (2, "host"),
    ]
    assert len({run["loss"] for run in runs}) == 1  # streaming changes no number
    in_memory, *streamed, host = runs
    assert in_memory["window_peak_bytes"] == 0
    peaks = [run["window_peak_bytes"] for run in streamed]
    assert 0 < peaks[0] < peaks[1] < peaks[2]
    assert streamed[0]["footprint_bytes"] < in_memory["footprint_bytes"]
    assert all(run["step_s"] > 0 and run["peak_memory_bytes"] > 0 for run in runs)
    assert (tmp_path / "layer_streaming.md").read_text().count("| streamed, window") == 4
    assert host["loss"] == in_memory["loss"] and host["window_peak_bytes"] == peaks[1]
