"""A Ray start that timed out is retried; any other failure is not. Ray's raylet timeout cannot be provoked on
demand, so `ray.init` is replaced by one that fails as it does."""

from __future__ import annotations

import logging

import pytest

ray = pytest.importorskip("ray")

from hydrafl.simulation.ray_start import ATTEMPTS, start_ray  # noqa: E402


def _init_failing(errors: list[Exception], calls: list[dict]):
    def init(**kwargs) -> None:
        calls.append(kwargs)
        if errors:
            raise errors.pop(0)

    return init


def test_a_timed_out_start_is_retried_and_other_errors_are_not(monkeypatch, caplog):
    timed_out = Exception(
        "The current node timed out during startup. This could happen because ..."
    )
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "init", _init_failing([timed_out], calls))
    with caplog.at_level(logging.WARNING, logger="hydrafl.simulation.ray_start"):
        start_ray(2)
    assert len(calls) == 2 and calls[1]["num_cpus"] == 2 and calls[1]["address"] == "local"
    assert "timed out (attempt 1 of 3)" in caplog.text
    calls.clear()
    monkeypatch.setattr(ray, "init", _init_failing([ValueError("bad argument")], calls))
    with pytest.raises(ValueError, match="bad argument"):
        start_ray(2)
    assert len(calls) == 1
    monkeypatch.setattr(ray, "init", _init_failing([timed_out] * ATTEMPTS, calls := []))
    with pytest.raises(Exception, match="timed out during startup"):
        start_ray(2)
    assert len(calls) == ATTEMPTS
