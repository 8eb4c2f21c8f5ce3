"""Beam search over the engine, as vLLM's ``LLM.beam_search`` does it: one token per beam per round, each beam a
request of one token with its top ``2 * beam_width`` log-probabilities, the beams of every prompt in one
``generate`` call. With prefix caching (the engine's default) a beam's prompt and output so far are found in the
KV cache, so a round computes about one new token per beam.

A candidate's score is its cumulative log-probability divided by its length to the power ``length_penalty``
(HF's and vLLM's ``get_beam_search_score``: the length counts the prompt and the output). Each round keeps the
``beam_width`` best candidates that do not end with end-of-sequence; those that do (unless ``ignore_eos``) are
finished. The answer is the ``beam_width`` best of the finished and the surviving beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.scheduler import SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``; validated on construction, errors name the field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSequence:
    """One beam: its tokens (prompt and output), output text and cumulative log-probability of the output."""

    tokens: list[int]
    cum_logprob: float = 0.0
    finished: bool = False
    text: str = ""


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSequence] = field(default_factory=list)


def score(beam: BeamSequence, length_penalty: float) -> float:
    return beam.cum_logprob / (len(beam.tokens) ** length_penalty)


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, adapter: str | None = None
                ) -> list[BeamSearchOutput]:
    """Beam search from each prompt (token ids); ``llm`` is an ``LLM``."""
    eos = set(llm.engine.eos_token_ids)
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, temperature=0, logprobs=2 * width, ignore_eos=True)
    beams = [[BeamSequence(list(p))] for p in prompts]
    finished: list[list[BeamSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        live = [(i, b) for i, group in enumerate(beams) for b in group]
        if not live:
            break
        outs = llm.generate([b.tokens for _, b in live], step_params, adapter=adapter, use_tqdm=False)
        candidates: list[list[BeamSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(live, outs):
            for token, logprob in out.outputs[0].logprobs[0].top.items():
                candidates[i].append(BeamSequence(beam.tokens + [token], beam.cum_logprob + logprob,
                                                  not params.ignore_eos and token in eos))
        for i, group in enumerate(candidates):
            group.sort(key=lambda b: score(b, params.length_penalty), reverse=True)
            kept = []
            for b in group:
                if b.finished:
                    finished[i].append(b)
                elif len(kept) < width:
                    kept.append(b)
            beams[i] = kept
    results = []
    for i, prompt in enumerate(prompts):
        best = sorted(finished[i] + beams[i], key=lambda b: score(b, params.length_penalty), reverse=True)[:width]
        for b in best:
            b.text = llm.tokenizer.decode(b.tokens[len(prompt):], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
