"""Co-serving groundwork: inference rows and a finetuning window in one forward call."""

from __future__ import annotations

import random

import pytest
import torch

from coserve.engine.mixed_forward import FinetuneSlice, mixed_forward
from coserve.finetune.pruned_layer import executor_plan, new_keeps, planned_keeps
from coserve.finetune.sequence_state import IGNORE_INDEX, new_sequence_state
from coserve.finetune.token_windows import backward_window, forward_window
from coserve.model.attention import PagedKVCache
from coserve.model.decoder import BATCH_INVARIANT_ROWS
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.model.loader import load_model
from coserve.peft.config import LoraConfig
from coserve.peft.lora_adapter import load_lora_adapter
from coserve.peft.lora_bank import LoraBank
from coserve.peft.trainable import TrainableLora
from peft_helpers import make_lora_adapter


def _bypass(model):
    b = TrainableLora(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "down_proj"]),
                      model.module_shapes(), model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05)
    return b


def _cache(model):
    c = model.cfg
    return PagedKVCache(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, model.device, model.dtype)


@pytest.mark.parametrize("remat", ["cheap", "all"])
@pytest.mark.parametrize("num_inference", [1, 3, 8, 21])
def test_finetuning_rows_in_an_inference_batch(model_factory, tmp_path, remat, num_inference):
    model_dir = model_factory("qwen2")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    c = model.cfg
    rng = random.Random(num_inference)
    ids = [rng.randrange(5, c.vocab_size) for _ in range(30)]
    targets = ids[1:] + [IGNORE_INDEX]
    adapter = load_lora_adapter("a", make_lora_adapter(model_dir, tmp_path / "a", r=4, lora_alpha=8,
                                                       target_modules=["v_proj", "down_proj"]),
                                model.module_shapes(), c.num_layers)
    bank = LoraBank(model.module_shapes(), c.num_layers, 2, 8, model.device, model.dtype)
    bank.activate([adapter])
    grads = []
    for mixed in (False, True):
        bypass = _bypass(model)
        state = new_sequence_state(ids, targets, c.num_layers, c.hidden_size, c.num_kv_heads, c.head_dim,
                                   model.device, model.dtype)
        if remat == "cheap":
            state.keeps = new_keeps(model, len(ids), planned_keeps(executor_plan(model, bypass.config, "cheap")))
        for window in (7, 9, 14):
            if not mixed:
                forward_window(model, bypass, state, window, 1 / 29)
                continue
            tokens = [rng.randrange(5, c.vocab_size) for _ in range(num_inference)]
            batch = build_forward_batch([tokens], [SequenceChunk(0, num_inference, num_inference, list(range(8)))],
                                        4, [], model.device)
            slots = [0] * (num_inference // 2) + [-1] * (num_inference - num_inference // 2)
            rows = max(num_inference, BATCH_INVARIANT_ROWS)  # alone, a small batch runs padded to 8 rows
            # half the inference rows use an adapter, half the bare model (and so do padding rows)
            padded = bank.batch(torch.tensor(slots + [-1] * (rows - num_inference)))
            alone = model.forward(batch, _cache(model), padded, min_rows=rows)
            hidden, _ = mixed_forward(model, batch, _cache(model), padded, FinetuneSlice(bypass, state, window, 1 / 29),
                                      adapter_rows=rows)
            # CPU GEMMs round rows the same from 8 rows on (measured): co-serving changes no bit
            assert torch.equal(hidden, alone)
            if num_inference < BATCH_INVARIANT_ROWS:  # and padding changes nothing but the last bits
                unpadded = model.forward(batch, _cache(model), bank.batch(torch.tensor(slots)))
                torch.testing.assert_close(unpadded, alone, atol=1e-5, rtol=0)
        while not state.finished:
            backward_window(model, bypass, state, 5)
        grads.append([p.grad.clone() for p in bypass.parameters()])
    for got, ref in zip(grads[1], grads[0]):
        assert ((got - ref).norm() / ref.norm()) <= 1e-5
