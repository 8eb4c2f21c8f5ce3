"""Every architecture on a CUDA device (skipped without one): greedy tokens as HF's on the same device, logprobs of
co-served requests bit for bit as alone, and finetuning windows (the plan's keeps, and attention's kept output under
the device's kernel pair and a sliding window's mask) as one whole-sequence autograd backward. On CUDA a model with
capped scores (Gemma 2) lays its batches out per chunk, without decode graphs; the others (sliding windows
included: Mistral here, Gemma 3) run CUDA's one variable-length attention call and replay decode graphs."""

from __future__ import annotations

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.bench.hf_reference import load_hf_model
from coserve.finetune.job import FinetuneJob
from coserve.finetune.config import FinetuneConfig
from coserve.model.loader import load_model
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora
from tests.conftest import ARCHS
from tests.test_batch_invariance import _logprobs, _prompts
from tests.test_coserving import _engine, _examples
from tests.test_model_parity import PROMPTS
from model_variants import phi3_longrope
from window_helpers import check_windows_match_autograd, perturbed_bypass

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
WINDOWED = {"mistral": {"sliding_window": 24}}  # the tiny Mistral attends to its whole context unless given one


SERVED = [*ARCHS, "phi3:longrope"]  # and LongRoPE past its original context of 32 (a decode graph's rows included)


def _model(model_factory, config_variant, arch):
    if arch == "phi3:longrope":
        return phi3_longrope(config_variant)
    return config_variant(arch, **WINDOWED[arch]) if arch in WINDOWED else model_factory(arch)


@pytest.mark.parametrize("arch", SERVED)
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompts", "chunks-of-7"])
def test_greedy_tokens_on_cuda_are_hfs(model_factory, config_variant, arch, chunk):
    path = _model(model_factory, config_variant, arch)
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(path, dtype="float32", device="cuda", **kw)
    graphs = llm.engine.executor.graphs
    assert (graphs is None) == (llm.engine.model_config.per_chunk_attention or llm.engine.model_config.moe)
    hf = load_hf_model(path).eval().to("cuda")
    ids = [(llm.tokenizer(p)["input_ids"] * 6)[:n] for p, n in zip(PROMPTS, (12, 30, 5, 38, 25))]
    outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for seq, out in zip(ids, outs):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([seq], device="cuda"), attention_mask=torch.ones(1, len(seq),
                               dtype=torch.long, device="cuda"), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False, pad_token_id=0)[0, len(seq):].tolist()
        assert out.token_ids == want, (arch, seq)
    if graphs is not None:
        assert graphs.replays > 0


def _every_module_job(engine, out_dir) -> FinetuneJob:
    """LoRA on every module the model adapts (PEFT's all-linear; a mixture's attention and its experts)."""
    model = engine.model
    experts = model.expert_shapes()
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=list(model.module_shapes()),
                      target_parameters=list(experts.modules) if experts else [])
    bypass = TrainableLora(peft, model.module_shapes(), model.cfg.num_layers, model.device,
                           torch.Generator().manual_seed(0), experts=experts)
    cfg = FinetuneConfig(output_dir=str(out_dir), batch_size=2, max_steps=2, epochs=2, lr=1e-2, optimizer="sgd",
                         lr_scheduler="constant", seed=0, shuffle=False)
    return FinetuneJob(model, bypass, _examples(model.cfg.vocab_size, 0), cfg)


@pytest.mark.parametrize("arch", SERVED)
def test_co_served_logprobs_on_cuda_are_bit_for_bit_as_alone(model_factory, config_variant, tmp_path, arch):
    model_dir = _model(model_factory, config_variant, arch)
    prompts = _prompts(7)
    alone = _logprobs(_engine(model_dir, device="cuda"), prompts)
    engine = _engine(model_dir, device="cuda")
    job = _every_module_job(engine, tmp_path / "job")
    engine.add_finetune_job(job)
    assert _logprobs(engine, prompts) == alone
    assert job.tokens_done > 0


@pytest.mark.parametrize("remat", ["cheap", "cheap:every"])
@pytest.mark.parametrize("arch", ARCHS)
def test_window_schedules_on_cuda_match_one_whole_sequence_backward(model_factory, config_variant, arch, remat):
    """47 tokens: past the 24 (Mistral) and 32 (Gemma) positions the sliding layers attend to. Every linear module
    bypassed. A window's matmuls have other shapes than the whole sequence's, and cuBLAS rounds them otherwise (MKL's
    strict mode, on a CPU, does not): on an H200 the worst parameter's relative error was 3.7e-6 to 3.6e-5 in float32,
    and 1.6e-4 on Gemma 2, whose scores the tiny model caps at 2 (``create-model``): the tanh saturates and
    ``1 - tanh^2`` magnifies a last-bit difference. A wrong mask or a missing term moves the gradients by 1e-3 or
    more."""
    model = load_model(_model(model_factory, config_variant, arch), torch.float32, torch.device("cuda"))
    bypass = perturbed_bypass(LoraConfig(r=4, lora_alpha=8, target_modules=list(model.module_shapes())), model, seed=4)
    check_windows_match_autograd(model, bypass, 47, remat, (5, 1, 30, 11), [1, 3, 16, 47], seed=1, dropout_seed=2,
                                 tol=5e-4 if arch == "gemma2" else 1e-4)
