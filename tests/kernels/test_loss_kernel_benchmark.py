"""The loss-kernel benchmark's probe measures the same loss both ways (in-process, tiny sizes; no timing asserted)."""

from __future__ import annotations

import pytest

from hydrafl.benchmarks.loss_kernel import probe


def test_probe_runs_both_variants_on_the_same_inputs() -> None:
    full, chunked = (
        probe(variant, rows=32, dim=8, vocab=300, reps=1) for variant in ("full", "chunked")
    )
    assert full["loss"] == pytest.approx(chunked["loss"], abs=1e-6)
    assert full["head_grad"] == pytest.approx(chunked["head_grad"], abs=1e-7)
    assert len(full["seconds"]) == len(chunked["seconds"]) == 1
    assert (
        min(
            full["peak_bytes"],
            chunked["peak_bytes"],
            probe("baseline", 32, 8, 300, 1)["peak_bytes"],
        )
        > 0
    )
