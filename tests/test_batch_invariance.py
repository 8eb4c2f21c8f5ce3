"""Co-serving must not change an inference output, bit for bit: a row's matmul result must not depend on the rows
computed beside it (coserve/model/batch_invariance.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from coserve.model.batch_invariance import invariance_violations, plan_fusion
from coserve.model.decoder import BATCH_INVARIANT_ROWS, gemm_layout
from coserve.model.loader import load_model
from coserve.model.packed_gemm import backend_available
from coserve.scheduler import SamplingParams
from tests.test_coserving import _engine, _job


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(rng.randint(3, 30))] for _ in range(8)]


def _logprobs(engine, prompts: list[list[int]]) -> list[list[tuple]]:
    """Greedy requests' logprobs (chosen and top 2 at every position), once they and any running jobs have ended."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids) or engine.has_running_jobs():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [[(lp.token_id, lp.logprob, lp.top) for lp in done[i].outputs[0].logprobs] for i in ids]


def _solo_job(model_dir, out_dir):
    """The test job trained alone, on an engine of its own."""
    from coserve.finetune.runner import run_job
    job = _job(_engine(model_dir), out_dir)
    run_job(job, progress=False)
    return job


def _co_served(engine, prompts: list[list[int]], out_dir) -> tuple[list, list, object]:
    """The prompts' logprobs on ``engine`` alone, then beside the test job (run to its end), and the job. The engine
    must not cache prefixes: the second pass would compute only the prompts' uncached tails (other prefill splits,
    which may round differently, whatever the job does)."""
    assert not engine.scheduler.blocks.enable_caching
    alone = _logprobs(engine, prompts)
    job = _job(engine, out_dir)
    engine.add_finetune_job(job)
    return alone, _logprobs(engine, prompts), job


def _assert_trained_as_alone(job, solo) -> None:
    assert job.step == solo.step and job.tokens_done > 0
    for a, b in zip(job.bypass.parameters(), solo.bypass.parameters()):
        assert (a - b).norm() / b.norm() <= 1e-5


def test_importing_coserve_asks_mkl_for_strict_reproducibility_unless_the_environment_says_otherwise():
    import subprocess
    import sys

    def mode(**env):
        base = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_CBWR", "COSERVE_"))}
        out = subprocess.run([sys.executable, "-c", "import coserve, os; print(os.environ['MKL_CBWR'])"],
                             env={**base, **env}, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    assert mode() == "AUTO,STRICT"
    assert mode(MKL_CBWR="COMPATIBLE") == "COMPATIBLE"


def test_a_down_proj_of_the_small_preset_rounds_each_row_as_it_would_alone():
    """The shape that broke it: a 1,408-input down_proj, whose rows MKL's default mode rounded differently in
    calls of 17-176 and 177 or more rows on a 2-core Xeon (threads split the sum)."""
    gen = torch.Generator().manual_seed(0)
    weight = gemm_layout(torch.randn(512, 1408, generator=gen))
    x = torch.randn(400, 1408, generator=gen)
    alone = F.linear(x[:BATCH_INVARIANT_ROWS], weight)
    for m in (9, 16, 17, 56, 57, 176, 177, 256, 400):
        assert torch.equal(F.linear(x[:m], weight)[:BATCH_INVARIANT_ROWS], alone), m


def test_the_probe_finds_rows_that_depend_on_their_neighbours(model_factory):
    model = load_model(model_factory("llama"), torch.float32, torch.device("cpu"))
    assert plan_fusion(model, "auto").batch_invariant  # with packs for MKL where this machine's oneDNN's are not
    assert invariance_violations(model) == []

    def uneven(x, w):  # a GEMM that rounds differently past 100 rows, as MKL's default mode did
        y = F.linear(x, w)
        return y + 1e-6 * y.abs() if x.shape[0] > 100 else y
    found = invariance_violations(model, linear=uneven)
    assert len(found) == 5 and all("[177, 300]" in f for f in found)


@pytest.mark.parametrize("targets", [("q_proj", "down_proj"), ("gate_proj",)])
def test_co_served_requests_get_the_same_logprobs_bit_for_bit(model_factory, tmp_path, targets):
    """Greedy tokens were always equal; logprobs are outputs too, and must be equal to the last bit. A job's bypass
    of ``gate_proj`` gives the MLP's gate a tensor of its own: the activation must still read every inference row as
    alone (the tiny model's 176-wide gate is no multiple of a CPU kernel's vector step)."""
    model_dir = model_factory("llama")
    prompts = _prompts(7)
    alone = _logprobs(_engine(model_dir), prompts)
    engine = _engine(model_dir)
    assert engine.batch_invariant and engine.executor.fuse_finetuning  # the window shares the matmul calls
    engine.add_finetune_job(_job(engine, tmp_path / "job", targets=targets))
    assert _logprobs(engine, prompts) == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_co_served_requests_get_the_same_logprobs_bit_for_bit_on_cuda(model_factory, tmp_path):
    """On the GPU, with the engine's default (``fuse_finetuning="auto"``: the window shares the matmul calls only
    where the probe found cuBLAS batch-invariant; decode-only iterations replay CUDA graphs, those with a fused
    window run eagerly)."""
    model_dir = model_factory("llama")
    prompts = _prompts(7)
    solo = _engine(model_dir, device="cuda")
    alone = _logprobs(solo, prompts)
    assert solo.executor.graphs.replays > 0  # alone, decode iterations replay CUDA graphs; beside the job, fused
    engine = _engine(model_dir, device="cuda")
    engine.add_finetune_job(_job(engine, tmp_path / "job"))
    assert _logprobs(engine, prompts) == alone


def test_standalone_finetuning_commands_give_mkl_back_its_own_mode(monkeypatch):
    """``coserve finetune`` and ``bench-finetune`` serve no inference: strict mode would only slow them."""
    from coserve.cli import main
    from coserve.model import batch_invariance

    calls = []
    monkeypatch.setattr(batch_invariance, "release_strict_cpu_gemms", lambda: calls.append(1))
    assert main(["finetune", "--model", "/nonexistent", "--data", "x.jsonl", "--output", "out"]) == 2
    assert main(["profile", "--model", "/nonexistent"]) == 2  # an engine-side command keeps strict mode
    assert calls == [1]
    monkeypatch.undo()

    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    monkeypatch.setenv("COSERVE_STRICT_GEMMS", "1")
    monkeypatch.setenv("COSERVE_MKL_CBWR_ORIGINAL", "")
    batch_invariance.release_strict_cpu_gemms()
    assert "MKL_CBWR" not in os.environ and os.environ["COSERVE_STRICT_GEMMS"] == "0"
    monkeypatch.setenv("COSERVE_MKL_CBWR_ORIGINAL", "COMPATIBLE")
    batch_invariance.release_strict_cpu_gemms()
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"
    # and a process it starts keeps MKL's own mode
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import coserve, os; print(os.environ.get('MKL_CBWR'))"],
                         env=dict(os.environ), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "COMPATIBLE"


def test_where_matmuls_are_not_batch_invariant_the_window_runs_in_calls_of_its_own(model_factory, tmp_path,
                                                                                  monkeypatch):
    """``fuse_finetuning="auto"``: a device whose rows depend on their neighbours (the probe says so) gets the
    finetuning forward window in matmul calls of its own, within the same iteration: outputs and adapter exact."""
    import pytest

    from coserve.engine import executor as executor_module
    from coserve.model import batch_invariance

    model_dir = model_factory("llama")
    prompts = _prompts(3)
    solo = _solo_job(model_dir, tmp_path / "solo")
    monkeypatch.setattr(batch_invariance, "invariance_violations",
                        lambda model, linear=None: ["down_proj (1408 -> 512) in calls of [17]"])
    monkeypatch.setattr(executor_module, "mixed_forward", lambda *a, **k: pytest.fail("fused a window"))
    engine = _engine(model_dir, enable_prefix_caching=False)
    assert not engine.batch_invariant and not engine.executor.fuse_finetuning
    alone, beside, job = _co_served(engine, prompts, tmp_path / "co")
    assert beside == alone
    _assert_trained_as_alone(job, solo)

    assert _engine(model_dir, fuse_finetuning="always").executor.fuse_finetuning  # the operator's choice
    with pytest.raises(ValueError, match="fuse_finetuning"):
        _engine(model_dir, fuse_finetuning="sometimes")


def test_only_a_co_serving_engine_warns_of_matmuls_that_are_not_batch_invariant(model_factory, monkeypatch, caplog):
    """The other policies never put a finetuning window beside inference rows: their engines say nothing of it."""
    import logging

    from coserve.model import batch_invariance
    monkeypatch.setattr(batch_invariance, "invariance_violations",
                        lambda model, linear=None: ["down_proj (1408 -> 512) in calls of [17]"])
    model_dir = model_factory("llama")
    for policy, warned in (("temporal", False), ("inference-only", False), ("coserve", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            engine = _engine(model_dir, policy=policy)
        assert not engine.batch_invariant
        assert any("not batch-invariant" in r.getMessage() for r in caplog.records) == warned, policy


def test_gemm_tiles_make_a_gemm_that_rounds_by_call_size_batch_invariant(model_factory, tmp_path, monkeypatch):
    """Where plain GEMMs round a row by the call's size (cuBLAS picks its kernel by size: measured on an H100), the
    engine runs them in tiles of a fixed row count and still fuses windows: logprobs equal to the last bit, the
    adapter as trained alone. Without the tiles the same fused GEMM changes the logprobs (the test can fail)."""
    from types import SimpleNamespace

    from coserve.model import batch_invariance, decoder, tiled_gemm

    def uneven(x, w, b=None):  # rounds differently in calls of more than 20 rows
        y = F.linear(x, w, b)
        return y + 1e-6 * y.abs() if x.shape[0] > 20 else y

    model_dir = model_factory("llama")
    prompts = _prompts(5)
    solo = _solo_job(model_dir, tmp_path / "solo")
    monkeypatch.setattr(tiled_gemm, "F", SimpleNamespace(linear=uneven))
    monkeypatch.setattr(decoder, "gemm_backend", lambda device, dtype: None)  # every GEMM is the uneven one
    monkeypatch.setattr(batch_invariance, "GEMM_TILE_ROWS", {})
    untiled = _engine(model_dir, fuse_finetuning="always", enable_prefix_caching=False)
    assert not untiled.batch_invariant and untiled.model.gemm_tile_rows == 0
    alone, beside, _ = _co_served(untiled, prompts, tmp_path / "untiled")
    assert beside != alone

    monkeypatch.setattr(batch_invariance, "GEMM_TILE_ROWS", {"cpu": 16})
    engine = _engine(model_dir, enable_prefix_caching=False)
    assert engine.batch_invariant and engine.executor.fuse_finetuning and engine.model.gemm_tile_rows == 16
    assert engine.model.padded_rows(1) == 16 and engine.model.padded_rows(17) == 32
    alone, beside, job = _co_served(engine, prompts, tmp_path / "co")
    assert beside == alone
    _assert_trained_as_alone(job, solo)
    assert not _engine(model_dir, fuse_finetuning="never").model.gemm_tile_rows  # no fusion, no tiles


class _UnevenPacks:
    """A packed GEMM library whose kernels round a row differently in calls of more than 20 rows (oneDNN's packs on
    a 16-core host rounded the LM head's rows by the call's size)."""

    def __init__(self, name: str) -> None:
        self.name, self.input_grad_rows = name, 1 << 30

    def available(self) -> bool:
        return True

    def pack(self, weight):
        return weight

    def mm(self, x, pack, weight, bias):
        y = F.linear(x, weight, bias)
        return y + 1e-6 * y.abs() if x.shape[0] > 20 else y


@pytest.mark.skipif(not backend_available("mkl"), reason="this torch has no MKL packed GEMM")
def test_packs_that_round_by_call_size_give_way_to_mkl_packs(model_factory, tmp_path, monkeypatch):
    """A CPU engine whose frozen weights were packed for oneDNN, where oneDNN's rows depend on their neighbours,
    packs them for MKL (strict mode: invariant) and fuses windows: logprobs equal to the last bit, the adapter as
    trained alone, the latency key naming MKL. Where MKL's are no better, or fusion is off, the packs stay."""
    from coserve.model import decoder, packed_gemm

    model_dir = model_factory("llama")
    prompts = _prompts(7)
    solo = _solo_job(model_dir, tmp_path / "solo")
    mkl = packed_gemm._BACKENDS["mkl"]
    monkeypatch.setitem(packed_gemm._BACKENDS, "onednn", _UnevenPacks("onednn"))
    monkeypatch.setitem(packed_gemm._BACKENDS, "mkl", _UnevenPacks("mkl"))
    monkeypatch.setattr(decoder, "gemm_backend", lambda device, dtype: "onednn")
    assert not _engine(model_dir).executor.fuse_finetuning  # MKL's no better: the packs stay, windows run apart
    uneven = _engine(model_dir, fuse_finetuning="always", enable_prefix_caching=False)
    assert uneven.model.gemms == "onednn-packed" and not uneven.batch_invariant
    alone, beside, _ = _co_served(uneven, prompts, tmp_path / "uneven")
    assert beside != alone  # such packs fused would change the outputs (the test can fail)

    monkeypatch.setitem(packed_gemm._BACKENDS, "mkl", mkl)
    engine = _engine(model_dir, enable_prefix_caching=False)
    assert engine.model.gemms == "mkl-packed" and engine.batch_invariant and engine.executor.fuse_finetuning
    assert engine.latency_key["gemms"] == "mkl-packed"
    alone, beside, job = _co_served(engine, prompts, tmp_path / "co")
    assert beside == alone
    _assert_trained_as_alone(job, solo)
    for policy in ("temporal", "inference-only"):  # they fuse nothing: no switch
        assert _engine(model_dir, policy=policy).model.gemms == "onednn-packed"


def test_a_fused_forward_runs_the_padded_inference_rows_in_a_call_of_their_own(monkeypatch):
    from types import SimpleNamespace

    from coserve.model import tiled_gemm

    assert [tiled_gemm.padded_rows(n, 8, 0) for n in (1, 8, 9)] == [8, 8, 9]
    assert [tiled_gemm.padded_rows(n, 8, 16) for n in (1, 16, 17, 33)] == [16, 16, 32, 48]
    x, w, b = torch.randn(40, 12), torch.randn(5, 12), torch.randn(5)
    calls = []

    def spy(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    monkeypatch.setattr(tiled_gemm, "F", SimpleNamespace(linear=spy))
    y = tiled_gemm.split_linear(x, w, b, 16)
    assert calls == [16, 24]
    assert torch.equal(y, torch.cat([F.linear(x[:16], w, b), F.linear(x[16:], w, b)]))
    calls.clear()
    for split in (0, 40, 48):  # no window rows past the split, or no split: one call
        tiled_gemm.split_linear(x, w, None, split)
    assert calls == [40, 40, 40]
