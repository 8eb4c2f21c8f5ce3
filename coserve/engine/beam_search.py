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


class BeamState:
    """The search over some prompts, one round at a time: ``pending()`` are the token lists to extend by one token
    (each with its top ``2 * beam_width`` log-probabilities), ``advance(tops)`` takes those, in order; a caller
    drives it (``beam_search`` with ``LLM.generate``; the server with its engine client)."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_ids: frozenset[int]) -> None:
        self.prompts, self.params, self.eos = prompts, params, eos_ids
        self.beams = [[BeamSequence(list(p))] for p in prompts]
        self.finished: list[list[BeamSequence]] = [[] for _ in prompts]
        self.rounds = 0
        self._live: list[tuple[int, BeamSequence]] = []

    @property
    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0, logprobs=2 * self.params.beam_width, ignore_eos=True)

    def pending(self) -> list[list[int]]:
        """The beams to extend this round (empty when the search is over)."""
        if self.rounds >= self.params.max_tokens:
            return []
        self._live = [(i, b) for i, group in enumerate(self.beams) for b in group]
        return [b.tokens for _, b in self._live]

    def advance(self, tops: list[dict[int, float]]) -> None:
        """One round: every live beam's top next tokens (token -> log-probability), in ``pending()`` order."""
        width, lp = self.params.beam_width, self.params.length_penalty
        candidates: list[list[BeamSequence]] = [[] for _ in self.prompts]
        for (i, beam), top in zip(self._live, tops):
            for token, logprob in top.items():
                candidates[i].append(BeamSequence(beam.tokens + [token], beam.cum_logprob + logprob,
                                                  not self.params.ignore_eos and token in self.eos))
        for i, group in enumerate(candidates):
            group.sort(key=lambda b: score(b, lp), reverse=True)
            kept = []
            for b in group:
                if b.finished:
                    self.finished[i].append(b)
                elif len(kept) < width:
                    kept.append(b)
            self.beams[i] = kept
        self.rounds += 1

    def results(self, decode) -> list[BeamSearchOutput]:
        """The best ``beam_width`` finished or surviving sequences of each prompt; ``decode(ids) -> text``."""
        out = []
        for i, prompt in enumerate(self.prompts):
            best = sorted(self.finished[i] + self.beams[i], key=lambda b: score(b, self.params.length_penalty),
                          reverse=True)[:self.params.beam_width]
            for b in best:
                b.text = decode(b.tokens[len(prompt):])
            out.append(BeamSearchOutput(best))
        return out


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, adapter: str | None = None
                ) -> list[BeamSearchOutput]:
    """Beam search from each prompt (token ids); ``llm`` is an ``LLM``."""
    state = BeamState(prompts, params, frozenset(llm.engine.eos_token_ids))
    while batch := state.pending():
        outs = llm.generate(batch, state.step_params, adapter=adapter, use_tqdm=False)
        state.advance([out.outputs[0].logprobs[0].top for out in outs])
    return state.results(lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True))
