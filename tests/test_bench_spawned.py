"""Benchmark runs in fresh processes: forked from a fork server where no GPU is visible, spawned where one is."""

from __future__ import annotations

import os

import pytest
import torch

from coserve.bench import spawned


def _report(key: str) -> tuple[str | None, int]:
    """What a run sees: an environment variable, and its pid."""
    return os.environ.get(key), os.getpid()


def _fail(message: str) -> None:
    raise ValueError(message)


def test_a_run_sees_the_callers_environment_of_the_moment_and_is_a_process_of_its_own(monkeypatch):
    monkeypatch.setenv("COSERVE_TEST_RUN", "first")
    value, pid = spawned.run_spawned(_report, "COSERVE_TEST_RUN", "a run")
    assert value == "first" and pid != os.getpid()
    monkeypatch.setenv("COSERVE_TEST_RUN", "second")  # the fork server, if one, started with "first"
    assert spawned.run_spawned(_report, "COSERVE_TEST_RUN", "a run")[0] == "second"
    monkeypatch.delenv("COSERVE_TEST_RUN")
    assert spawned.run_spawned(_report, "COSERVE_TEST_RUN", "a run")[0] is None


def test_a_runs_error_comes_back_naming_the_run():
    with pytest.raises(RuntimeError, match="run coserve @ 2 req/s failed: ValueError: no such policy"):
        spawned.run_spawned(_fail, "no such policy", "run coserve @ 2 req/s")


def test_the_start_method_follows_the_device_and_the_override(monkeypatch):
    spawned.context.cache_clear()
    try:
        monkeypatch.delenv("COSERVE_BENCH_START", raising=False)
        expected = "spawn" if torch.cuda.is_available() else "forkserver"
        assert spawned.context().get_start_method() == expected
        spawned.context.cache_clear()
        monkeypatch.setenv("COSERVE_BENCH_START", "spawn")
        assert spawned.context().get_start_method() == "spawn"
        spawned.context.cache_clear()
        monkeypatch.setenv("COSERVE_BENCH_START", "fork")
        with pytest.raises(ValueError, match="COSERVE_BENCH_START: 'fork' is not spawn or forkserver"):
            spawned.context()
    finally:
        spawned.context.cache_clear()
