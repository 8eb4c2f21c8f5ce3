"""The offline Python API, as vLLM users know it: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from coserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from coserve.engine.config import EngineConfig
from coserve.engine.engine_loop import EngineLoop
from coserve.engine.loop_client import LoopClient, merge_sequences, sequences
from coserve.engine.finetune_handle import FinetuneHandle
from coserve.engine.grpo_run import GRPOHandle, GRPORun
from coserve.finetune.build import load_training, new_job, starting_bypass
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.grpo_prompts import load_prompts
from coserve.model.chat_prompt import ChatPromptError, render_conversation
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import load_model_trainable
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import (EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                                     ScoringRequestOutput)
from coserve.scheduler import PoolingParams, SamplingParams

Prompt = str | list[int]


class LLM:
    """A model ready to generate, with LoRA and IA3 adapters loadable at run time.

    Example::

        llm = LLM("path/to/model", dtype="float32")
        llm.load_adapter("sql", "path/to/peft_adapter")
        outs = llm.generate(["a", "b"], SamplingParams(max_tokens=32, temperature=0), adapter=["sql", None])
    """

    def __init__(self, model: str | Path, **kwargs) -> None:
        """``kwargs`` are EngineConfig fields (dtype, device, max_model_len, max_loras, ...)."""
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self.model_dir = Path(model)
        self._loop: EngineLoop | None = None  # the background engine thread, once a job has started
        # Held while a ``generate`` steps the engine in its caller's thread: calls from several threads take turns
        # (each stepped the engine at once, taking the others' outputs: they waited for good), and the background
        # thread starts only between them.
        self._stepping = threading.Lock()

    def finetune(self, data: str | Path, peft: LoraConfig | IA3Config | None = None,
                 config: FinetuneConfig | None = None, tenant: str = "default",
                 validation: str | Path | None = None, reward_funcs=None,
                 reward_weights=None, resume_from: str | Path | None = None) -> FinetuneHandle | GRPOHandle:
        """Start a finetuning job co-served with ``generate`` calls (the engine then runs in a background thread).

        ``data``: a JSON/JSONL file ({text}, Alpaca or OpenAI chat records, as ``coserve finetune``; with
        ``config.method`` dpo, simpo or orpo, preference pairs: OpenAI's DPO records or TRL's prompt/chosen/rejected);
        ``peft``: LoraConfig (default: r=16 on down_proj) or IA3Config (none with ``config.start_adapter`` or
        ``config.dpo_reference``: the job then trains a copy of that adapter); ``config``: FinetuneConfig
        (``output_dir`` is required). The adapter is written to ``output_dir`` when the job ends.
        ``tenant``: whose job it is (the Virtual Token Counter shares the engine among tenants).
        ``validation``: a file of the same formats whose mean loss per target token is logged
        (``valid_loss``) after every epoch and the last step (GRPO: prompts whose mean reward is, ``valid_reward``).

        With ``config.method`` grpo (``coserve/engine/grpo_run.py``), ``data`` holds prompts (TRL's prompt-only
        records: ``{"prompt": text or messages, ...}``), ``reward_funcs`` are functions called as TRL calls them,
        ``f(prompts=, completions=, completion_ids=, **the records' other fields) -> rewards`` (None where one does
        not apply), summed with ``reward_weights`` (default 1 each); a ``GRPOHandle`` is returned.
        ``resume_from``: a checkpoint directory (an ``output_dir`` or a ``checkpoint-STEP`` a job wrote) whose
        adapter, optimizer state and step the job continues from (``coserve finetune --init-adapter``); ``peft``
        must then be None.
        """
        if config is None:
            raise ValueError("config: a FinetuneConfig with output_dir is required")
        if self.engine.config.policy == "inference-only":
            raise ValueError("policy: this LLM was made with policy='inference-only', which never runs finetuning")
        model = self.engine.model
        if resume_from is not None and peft is not None:
            raise ValueError("peft: a resumed job trains the checkpoint's adapter (give no peft config)")
        if config.method == "grpo":
            return self._grpo(data, peft, config, tenant, validation, reward_funcs, reward_weights, resume_from)
        if reward_funcs is not None or reward_weights is not None:
            raise ValueError(f"reward_funcs: rewards are for method grpo, not {config.method}")
        examples, report = load_training(data, self.tokenizer, config)
        held_out = None if validation is None else load_training(validation, self.tokenizer, config)[0]
        bypass = self._starting_bypass(peft, config, resume_from)
        job = new_job(model, bypass, examples, config, base_model=str(self.model_dir.resolve()), validation=held_out,
                      resume_from=Path(resume_from) if resume_from is not None else None)
        loop = self._background()
        job_id = loop.call(lambda: self.engine.add_finetune_job(job, tenant=tenant))
        return FinetuneHandle(self, job_id, Path(config.output_dir), report.summary())

    def _starting_bypass(self, peft, config: FinetuneConfig, resume_from):
        """The new job's trainable adapter: the checkpoint's when resuming, else ``starting_bypass``'s."""
        model = self.engine.model
        if resume_from is None:
            return starting_bypass(peft, model, config)
        if not Path(resume_from).is_dir():
            raise ValueError(f"resume_from: {resume_from} is not a directory")
        return load_model_trainable(resume_from, model)

    def _grpo(self, data, peft, config: FinetuneConfig, tenant: str, validation, reward_funcs,
              reward_weights, resume_from) -> GRPOHandle:
        if config.max_seq_len > self.engine.max_model_len:  # prompt and completion within the context
            config = replace(config, max_seq_len=self.engine.max_model_len)
        prompts, report = load_prompts(data, self.tokenizer, config.max_seq_len, config.max_completion_tokens)
        held_out = None
        if validation is not None:
            held_out = load_prompts(validation, self.tokenizer, config.max_seq_len, config.max_completion_tokens)[0]
        bypass = self._starting_bypass(peft, config, resume_from)
        run = GRPORun(LoopClient(self._background()), prompts, reward_funcs, reward_weights, bypass, config,
                      tenant, base_model=str(self.model_dir.resolve()), resume_from=resume_from, validation=held_out)
        run.start()
        return GRPOHandle(run, report.summary())

    def _background(self) -> EngineLoop:
        if self._loop is None:
            with self._stepping:
                if self._loop is None:
                    self._loop = EngineLoop(self.engine)
        return self._loop

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _on_engine(self, fn):
        """``fn()`` where nothing steps the engine meanwhile: on its thread between iterations once it has one,
        else between other threads' ``generate`` calls."""
        if self._loop is None:
            with self._stepping:
                if self._loop is None:
                    return fn()
        return self._loop.call(fn)

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a HF PEFT LoRA or IA3 adapter directory to serve under ``name``."""
        self._on_engine(lambda: self.engine.load_adapter(name, path))

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; refused while requests still use it."""
        self._on_engine(lambda: self.engine.unload_adapter(name))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None,
                 use_tqdm: bool = False, tenant: str = "default",
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``prompts`` are strings (tokenized like ``tokenizer(prompt)`` in transformers) or
        token-id lists; ``sampling_params``, ``adapter`` and ``priority`` (lower first, under
        ``scheduling_policy="priority"``) are one for all or one per prompt. Every prompt is validated
        before any work starts. ``tenant``: whose requests they are.
        """
        prompts = _prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params",
                             SamplingParams)
        adapters = _per_prompt(adapter, len(prompts), "adapter", (str, type(None)))
        priorities = _per_prompt(priority, len(prompts), "priority", int)
        built = []
        for i, (p, sp, a, pr) in enumerate(zip(prompts, params, adapters, priorities)):
            try:
                built += [self.engine.make_request(p, one, a, tenant=tenant, priority=pr) for one in sequences(sp)]
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        return merge_sequences(self._run(built, use_tqdm), [sp.n for sp in params])

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              adapter: str | None | Sequence[str | None] = None, use_tqdm: bool = False, tenant: str = "default",
              priority: int | Sequence[int] = 0) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's embedding, in prompt order: its last token's final hidden state
        (after the model's last norm), L2-normalized (``PoolingParams``: ``dimensions``, ``normalize``,
        ``truncate_prompt_tokens``). Embedding requests share the engine's iterations with generation and finetuning,
        and a prompt's embedding does not depend on what runs beside it. ``adapter``: a loaded LoRA or IA3 adapter
        (one for all or one per prompt). Raises RuntimeError naming the prompt whose iteration failed."""
        prompts = _prompt_list(prompts)
        params = _per_prompt(pooling_params or PoolingParams(), len(prompts), "pooling_params", PoolingParams)
        adapters = _per_prompt(adapter, len(prompts), "adapter", (str, type(None)))
        priorities = _per_prompt(priority, len(prompts), "priority", int)
        built = []
        for i, (p, pp, a, pr) in enumerate(zip(prompts, params, adapters, priorities)):
            try:
                built.append(self.engine.make_request(p, pp, a, tenant=tenant, priority=pr))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        results = []
        for i, out in enumerate(self._run(built, use_tqdm)):
            if out.embedding is None:
                raise RuntimeError(f"prompts[{i}]: the engine failed while embedding it ({out.error})")
            results.append(EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding),
                                                  True, out.num_cached_tokens))
        return results

    def score(self, data_1: Prompt | Sequence[Prompt], data_2: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, adapter: str | None = None, use_tqdm: bool = False,
              tenant: str = "default", priority: int = 0) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` with an embedding model: each pair's cosine similarity of the two prompts'
        embeddings (``embed``). One ``data_1`` is scored against every ``data_2``; two lists pair up by position
        (they must be equally long). A shared first prompt is embedded once."""
        first, second = _prompt_list(data_1), _prompt_list(data_2)
        for name, prompts in (("data_1", first), ("data_2", second)):
            if not prompts:
                raise ValueError(f"{name}: is empty")
        if len(first) != 1 and len(first) != len(second):
            raise ValueError(f"data_1: {len(first)} prompts for {len(second)} in data_2 (give one, or as many)")
        params = pooling_params or PoolingParams()
        if not params.normalize:
            raise ValueError("pooling_params.normalize: scores are cosine similarities of normalized embeddings")
        embedded = self.embed([*first, *second], params, adapter, use_tqdm, tenant, priority)
        queries, texts = embedded[:len(first)], embedded[len(first):]
        return [ScoringRequestOutput(
                    text.request_id, text.prompt_token_ids,
                    ScoringOutput(sum(x * y for x, y in zip(queries[0 if len(queries) == 1 else i].outputs.embedding,
                                                             text.outputs.embedding))))
                for i, text in enumerate(texts)]

    def _run(self, built: list, use_tqdm: bool) -> list[RequestOutput]:
        """Run requests built by ``make_request`` to their ends; their final outputs in order."""
        if self._loop is None:
            with self._stepping:
                if self._loop is None:
                    return self._run_here(built, use_tqdm)
        return LoopClient(self._loop).run(built)  # the engine runs in its thread (since a job started)

    def _run_here(self, built: list, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine in this thread until ``built``'s requests have finished (under ``_stepping``)."""
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

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    adapter: str | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` best continuations of each prompt, best first
        (``coserve/engine/beam_search.py``)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
        return beam_search(self, ids, params, adapter)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             adapter: str | None | Sequence[str | None] = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template.

        ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts) or a list of them. As vLLM's
        ``LLM.chat``: ``continue_final_message`` (with ``add_generation_prompt=False``) continues the last message
        instead of opening a new turn; ``chat_template_kwargs`` are more variables for the template.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(render_conversation(self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                                                   continue_final_message=continue_final_message,
                                                   chat_template_kwargs=chat_template_kwargs))
            except ChatPromptError as e:
                if e.param != "messages":
                    raise
                raise ValueError(f"messages[{i}]: the chat template cannot render it ({e.__cause__})") from e
        # The template already holds the special tokens: tokenize without adding more.
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.generate(ids, sampling_params, adapter)


def _prompt_list(prompts) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                    and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts: a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    return list(prompts)


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
