"""CUDA graphs of the decode forward (coserve/model/decode_graphs.py): replays give the eager forward's outputs bit
for bit (and a co-served job leaves them unchanged: test_batch_invariance.py). The graph tests need a CUDA device;
the bucketing is plain arithmetic, and which plans the executor hands to the graphs is checked anywhere."""

from __future__ import annotations

import pytest
import torch

from coserve.model.decode_graphs import MIN_GRAPH_BLOCKS, block_bucket, row_bucket
from coserve.model.forward_batch import build_forward_batch
from tests.test_batch_invariance import _logprobs, _prompts
from tests.conftest import ARCHS
from tests.test_coserving import _engine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_graphs_gather_blocks_in_steps_of_at_most_one_and_a_half_within_the_longest_sequence():
    sizes = (1, 4, 5, 7, 9, 40, 100, 128)
    assert [block_bucket(n, 128) for n in sizes] == [MIN_GRAPH_BLOCKS, 4, 6, 8, 12, 48, 128, 128]
    assert block_bucket(30, 20) == 24  # a model whose longest sequence takes 20 blocks: the bucket that covers it
    assert [row_bucket(n, 1) for n in (8, 9, 100)] == [8, 16, 128]
    assert [row_bucket(n, 128) for n in (128, 256, 384)] == [128, 256, 512]  # GEMM tiles: powers of two of them


@needs_cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_decode_steps_give_the_eager_logprobs_bit_for_bit(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = _prompts(11)
    eager = _logprobs(_engine(model_dir, device="cuda", cuda_graphs=False), prompts)
    engine = _engine(model_dir, device="cuda")
    graphed = _logprobs(engine, prompts)
    if engine.model_config.per_chunk_attention or engine.model_config.moe:  # capped scores (Gemma 2: attention per
        # chunk) or experts (calls of the rows routed to them): no graphs
        assert engine.executor.graphs is None
    else:
        assert engine.executor.graphs.replays > 0
    assert graphed == eager



class _EagerStandIn:
    """Stands in for ``DecodeGraphs`` where there is no GPU: the executor's graph branch, the eager forward behind."""

    def __init__(self, engine) -> None:
        self.model, self.cache, self.calls = engine.model, engine.cache, []

    def covers_lengths(self, chunks) -> bool:
        return bool(chunks) and all(len(c.token_ids) == 1 for c in chunks)

    def forward(self, token_ids, chunks, min_rows):
        self.calls.append(len(chunks))
        batch = build_forward_batch([[t] for t in token_ids], chunks, self.cache.block_size,
                                    list(range(len(chunks))), self.model.device)
        return self.model.forward(batch, self.cache, None, min_rows=min_rows)


def test_the_executor_hands_decode_only_plans_to_the_graphs_and_samples_from_what_they_return(model_factory):
    model_dir = model_factory("llama")
    prompts = _prompts(13)
    eager = _logprobs(_engine(model_dir), prompts)
    engine = _engine(model_dir)
    stand_in = engine.executor.graphs = _EagerStandIn(engine)
    plans = []
    execute = engine.executor.execute
    engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)
    assert _logprobs(engine, prompts) == eager
    decode_only = [p for p in plans if p.chunks and all(len(c.token_ids) == 1 for c in p.chunks)]
    assert stand_in.calls == [len(p.chunks) for p in decode_only] and decode_only  # and no plan with a prompt chunk


@needs_cuda
def test_an_engine_whose_graphs_cannot_be_recorded_serves_eagerly(model_factory, monkeypatch):
    from coserve.model.decode_graphs import DecodeGraphs

    def fail(self):
        raise RuntimeError("capture not supported here")

    monkeypatch.setattr(DecodeGraphs, "record_all", fail)
    model_dir = model_factory("llama")
    engine = _engine(model_dir, device="cuda")
    assert engine.executor.graphs is None
    prompts = _prompts(14)
    assert _logprobs(engine, prompts) == _logprobs(_engine(model_dir, device="cuda", cuda_graphs=False), prompts)
