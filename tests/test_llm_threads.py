"""``LLM`` called from several threads at once (a web app's worker pool): each ``generate`` stepped the engine in
its own thread and took the others' outputs, so they waited for good. Calls now take turns until a job starts the
engine's own thread, and then share it; adapters load between iterations either way."""

from __future__ import annotations

import json
import threading
import time

from coserve import LLM, FinetuneConfig, LoraConfig, SamplingParams
from peft_helpers import make_lora_adapter

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [f"prompt number {i}" for i in range(6)]


def _in_threads(*targets, timeout: float = 90) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]  # a hung one: no hang
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a call never returned"
    return errors


def test_generate_from_several_threads_gives_each_its_own_outputs(model_factory, tmp_path):
    model = model_factory("llama")
    llm = LLM(model, dtype="float32", device="cpu")
    reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    got: list[list[list[int]]] = []

    def calls():
        for _ in range(3):
            got.append([o.token_ids for o in llm.generate(PROMPTS, PARAMS)])

    adapter = make_lora_adapter(model, tmp_path / "ad", r=4, lora_alpha=8, target_modules=["q_proj"])

    def adapters():
        for _ in range(3):
            llm.load_adapter("ad", adapter)
            llm.unload_adapter("ad")

    assert _in_threads(calls, calls, calls, adapters) == []
    assert len(got) == 9 and all(g == reference for g in got)

    data = tmp_path / "d.jsonl"  # a job starts the engine's thread while other threads generate
    data.write_text("".join(json.dumps({"text": f"some words {i} " * 4}) + "\n" for i in range(4)))
    jobs = []

    def finetune():
        jobs.append(llm.finetune(data, LoraConfig(r=4, lora_alpha=8),
                                 FinetuneConfig(output_dir=str(tmp_path / "out"), max_steps=2)))

    got.clear()
    assert _in_threads(calls, finetune, calls) == []
    assert len(got) == 6 and all(g == reference for g in got)
    assert jobs[0].wait(timeout=120)["status"] == "succeeded"
