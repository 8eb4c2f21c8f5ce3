"""While the server runs, the interpreter hands the GIL between its threads every ``gil_switch_interval_ms``
(0.5 ms by default, Python's own is 5 ms), so the event loop waits less on the engine thread; the previous
interval is back once the server stops."""

from __future__ import annotations

import sys

import pytest
from fastapi.testclient import TestClient

from coserve.engine.config import EngineConfig
from coserve.server.app import build_app
from coserve.server.config import ServerConfig


@pytest.mark.parametrize("interval_ms", [None, 2.0])
def test_the_server_sets_the_switch_interval_while_it_runs_and_restores_it(model_factory, tmp_path, interval_ms):
    model_dir = model_factory("llama")
    extra = {} if interval_ms is None else {"gil_switch_interval_ms": interval_ms}
    app = build_app(ServerConfig(model=str(model_dir), state_dir=str(tmp_path / "state"), **extra),
                    EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4))
    before = sys.getswitchinterval()
    with TestClient(app) as http:
        assert sys.getswitchinterval() == pytest.approx((interval_ms or 0.5) / 1000)
        assert http.get("/health").status_code == 200
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("bad", [0, -1.0, 5000.0, "1"])
def test_a_bad_switch_interval_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--gil-switch-interval-ms"):
        ServerConfig(model="m", state_dir="s", gil_switch_interval_ms=bad)
