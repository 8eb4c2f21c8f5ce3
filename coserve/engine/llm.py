"""The offline Python API, as vLLM users know it: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import RequestOutput
from coserve.scheduler import SamplingParams

Prompt = str | list[int]


class LLM:
    """A model ready to generate, with LoRA adapters loadable at run time.

    Example::

        llm = LLM("path/to/model", dtype="float32")
        llm.load_adapter("sql", "path/to/peft_adapter")
        outs = llm.generate(["a", "b"], SamplingParams(max_tokens=32, temperature=0), adapter=["sql", None])
    """

    def __init__(self, model: str | Path, **kwargs) -> None:
        """``kwargs`` are EngineConfig fields (dtype, device, max_model_len, max_loras, ...)."""
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a HF PEFT LoRA adapter directory to serve under ``name``."""
        self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``prompts`` are strings (tokenized like ``tokenizer(prompt)`` in transformers) or
        token-id lists; ``sampling_params`` and ``adapter`` are one for all or one per
        prompt. Every prompt is validated before any work starts.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params",
                             SamplingParams)
        adapters = _per_prompt(adapter, len(prompts), "adapter", (str, type(None)))
        built = []
        for i, (p, sp, a) in enumerate(zip(prompts, params, adapters)):
            try:
                built.append(self.engine.make_request(p, sp, a))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        order = {}
        for i, (request, text) in enumerate(built):
            self.engine.enqueue(request, text)
            order[request.request_id] = i
        results: list[RequestOutput | None] = [None] * len(built)
        bar = tqdm(total=len(built), disable=not use_tqdm, desc="generate")
        while any(r is None for r in results):
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             adapter: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template.

        ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=True,
                                                                  tokenize=False))
            except Exception as e:  # jinja and transformers raise many kinds
                raise ValueError(f"messages[{i}]: the chat template cannot render it ({e})") from e
        # The template already holds the special tokens: tokenize without adding more.
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.generate(ids, sampling_params, adapter)


def _per_prompt(value, n: int, name: str, kind) -> list:
    """One value for every prompt, or a list with exactly one per prompt."""
    if isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} given for {n} prompts")
    for v in values:
        if not isinstance(v, kind):
            raise ValueError(f"{name}: {v!r} has the wrong type")
    return values
