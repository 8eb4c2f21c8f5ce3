"""Shared fixtures: tiny random models of each architecture, made once per test session."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import coserve  # noqa: F401  (first: it asks MKL for batch-invariant GEMMs before any test multiplies)
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# The float32 exactness tests (against HF at 1e-4 / 1e-5, bitwise batch invariance) need IEEE float32
# matmuls on CUDA too: TF32 is off by default in torch; pinned here so that nothing imported turns it on.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# Latency profiles the engines make (a brief one when none fits) go to a scratch file, not the user's cache.
os.environ["COSERVE_PROFILE"] = os.path.join(tempfile.mkdtemp(prefix="coserve-test-"), "latency.json")
# The packed-GEMM backend this machine was timed to run best is kept in a scratch file too (model/gemm_choice.py).
os.environ["COSERVE_GEMMS_FILE"] = os.path.join(os.path.dirname(os.environ["COSERVE_PROFILE"]), "gemms.json")

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3", "granite", "smollm3", "olmo2", "mixtral",
         "qwen3_moe", "olmoe", "qwen2_moe", "seed_oss", "olmo3", "glm4_moe", "gpt_oss")
_GEMM_ENV = {k: os.environ.get(k) for k in ("MKL_CBWR", "COSERVE_STRICT_GEMMS", "COSERVE_MKL_CBWR_ORIGINAL")}


@pytest.fixture(autouse=True)
def _gemm_environment(monkeypatch):
    """In-process runs of ``coserve finetune`` give MKL its own mode back in the environment: undone after each
    test, so that the servers later tests start are batch-invariant as a user's are."""
    for key, value in _GEMM_ENV.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """``make(arch, **create_model kwargs) -> Path``, cached per argument set."""
    from coserve.model.create import create_model
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = create_model(out, preset="tiny", arch=arch, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def config_variant(model_factory, tmp_path_factory):
    """``variant(arch, **fields) -> Path``: a copy of the tiny ``arch`` model whose config.json has ``fields`` set
    (e.g. ``sliding_window=8``: the same weights, every layer sliding over 8 positions), cached per argument set."""
    made: dict[str, Path] = {}

    def variant(arch: str, **fields) -> Path:
        key = repr((arch, sorted(fields.items())))
        if key not in made:
            src = model_factory(arch)
            out = tmp_path_factory.mktemp(f"tiny-{arch}-variant") / "model"
            shutil.copytree(src, out)
            cfg = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**cfg, **fields}))
            made[key] = out
        return made[key]

    return variant


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request, model_factory) -> Path:
    """A tiny model directory, once per architecture."""
    return model_factory(request.param)


@pytest.fixture(scope="session")
def hf_model_cache():
    """Loads HF reference models once per directory."""
    from coserve.bench.hf_reference import load_hf_model
    cache: dict[str, object] = {}

    def get(path: Path, dtype=torch.float32):
        key = f"{path}:{dtype}"
        if key not in cache:
            cache[key] = load_hf_model(path, dtype).eval()  # Gemma 2 through eager attention (hf_reference.py)
        return cache[key]

    return get


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data``; tests that need it skip cleanly when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def api_server(model_factory, tmp_path_factory):
    """A live ``coserve serve`` on the tiny Llama, shared by the modules that only call its API (preference and
    reinforcement jobs, graders, uploads): tenants alice and bob (``server_helpers.API_KEYS``), the base named
    ``tiny-llama``, small upload limits (``API_PART_BYTES`` a request, ``API_FILE_BYTES`` a file made of parts) and
    python graders on. Each server start costs several seconds of imports, so modules that need no flags of their
    own share this one."""
    from server_helpers import API_FILE_BYTES, API_KEYS, API_PART_BYTES, start_server
    root = tmp_path_factory.mktemp("serve-api")
    keys = root / "keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in API_KEYS.items()))
    srv = start_server(model_factory("llama"), root / "state", "--api-keys", str(keys), "--served-model-name",
                       "tiny-llama", "--max-upload-bytes", str(API_PART_BYTES), "--max-file-bytes", str(API_FILE_BYTES),
                       "--python-graders")
    yield srv
    srv.stop()
