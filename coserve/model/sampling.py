"""Token sampling from float32 logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coserve.model.logit_adjust import LogitAdjustments, adjust_logits


@dataclass(slots=True)
class SamplingRow:
    """How to sample one row of logits (plain numbers; no dependency on the scheduler)."""

    temperature: float  # 0 = greedy
    top_k: int  # -1 or 0 = off
    top_p: float  # 1.0 = off
    generator: torch.Generator | None  # the request's own RNG when it has a seed
    adjust: LogitAdjustments | None = None  # penalties and biases, if the request has any
    allowed: torch.Tensor | None = None  # bool [V]: the only tokens it may sample (guided decoding), or None
    min_p: float = 0.0  # 0 = off


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: torch.Generator | None = None) -> list[int]:
    """One token per row of ``logits`` ``[N, V]``: greedy rows by one argmax; the others filtered together
    (``filtered_probs``) and drawn together (``draw``). One read back for every row. ``logits`` is left as it was
    (penalised and guided rows are copies). A row whose masks leave it no token at all (a guide, ``allowed_token_ids``
    and ``min_tokens``' ban that contradict each other) samples from its raw logits, as a guide with no token to
    offer leaves its request unguided: every logit -inf drew a token id past the vocabulary, which failed the whole
    iteration (every request in it, and a fused finetuning slice's job)."""
    if any(row.adjust is not None or row.allowed is not None for row in rows):
        raw, logits = logits, logits.clone()
        for i, row in enumerate(rows):
            if row.adjust is not None:
                logits[i] = adjust_logits(logits[i], row.adjust)
            if row.allowed is not None:
                logits[i].masked_fill_(~row.allowed, float("-inf"))
        left = (logits > float("-inf")).any(dim=-1, keepdim=True)
        logits = torch.where(left, logits, raw)  # no read-back to find such rows: one select for all of them
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if row.temperature != 0 and row.top_k != 1]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        tokens[index] = draw(filtered_probs(logits[index], [rows[i] for i in drawn]),
                             [rows[i].generator for i in drawn], default_generator)
    return tokens.tolist()


def draw(probs: torch.Tensor, generators: list[torch.Generator | None],
         default_generator: torch.Generator | None = None) -> torch.Tensor:
    """A token per row of ``probs`` ``[M, V]`` by inverse transform: one uniform number a row, found in the row's
    cumulative distribution (float64). A row with a generator of its own draws its number from it (so a seeded
    row's token depends on its seed and its probabilities alone, whatever the batch); the others draw theirs from
    ``default_generator`` together. ``torch.multinomial`` cost as much as a decode step of the ``small`` model on
    a 2-core CPU at 128 rows (23 ms; it draws a random number per vocabulary entry); this, 0.6 ms."""
    m, device = probs.shape[0], probs.device
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    u = torch.empty(m, 1, dtype=torch.float64, device=device)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        u[torch.tensor(shared, device=device)] = torch.rand(len(shared), 1, dtype=torch.float64, device=device,
                                                            generator=default_generator)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, dtype=torch.float64, device=device, generator=g)
    picks = torch.searchsorted(cdf, u * total, right=True)  # the first token whose cumulative mass passes u
    last = torch.searchsorted(cdf, total)  # the last token with any mass (u * total can round up to the total)
    return torch.minimum(picks, last).squeeze(1)


def filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Probabilities ``[M, V]`` of ``logits`` ``[M, V]`` after each row's temperature, min-p (vLLM's order), top-k
    and top-p, all rows at once (each filter runs only where some row asks for it, and leaves the other rows
    as they are)."""
    device, vocab = logits.device, logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    scaled = logits / column([row.temperature for row in rows])
    if any(row.min_p > 0 for row in rows):  # a row with min_p 0 keeps every token (no probability is below 0)
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < column([row.min_p for row in rows]) * probs.amax(-1, keepdim=True),
                                    float("-inf"))
    ks = [row.top_k if 0 < row.top_k < vocab else 0 for row in rows]
    if any(ks):
        top = torch.topk(scaled, max(ks), dim=-1).values  # [M, max k], descending
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).unsqueeze(1))
        off = torch.tensor([k == 0 for k in ks], device=device).unsqueeze(1)
        kth = kth.masked_fill(off, float("-inf"))  # top-k off: nothing below
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    nucleus = [j for j, row in enumerate(rows) if row.top_p < 1.0]
    if nucleus:
        index = torch.tensor(nucleus, device=device)
        scaled = scaled.index_copy(0, index, _top_p(scaled[index], [rows[j].top_p for j in nucleus]))
    return scaled.softmax(-1)


# Top-p first sorts only this many of a row's likeliest tokens, which hold the nucleus wherever their mass reaches
# top-p (a row where they do not is sorted whole). Sorting a whole row was most of top-p's time: 128 rows of 8,192
# logits took 31 ms to sort here (2-core Zen 4) and 5 ms for their top 256.
TOP_P_CANDIDATES = 256


def _top_p(scaled: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """``scaled`` ``[M, V]`` with every token dropped (-inf) that comes after tokens already holding ``top_p`` of
    its row's probability (the top token always stays)."""
    limit = torch.tensor(top_p, dtype=scaled.dtype, device=scaled.device).unsqueeze(1)
    k = min(scaled.shape[-1], TOP_P_CANDIDATES)
    values, order = scaled.topk(k, dim=-1)  # descending
    probs = (values - scaled.logsumexp(-1, keepdim=True)).exp()
    mass = probs.cumsum(-1)
    out = torch.full_like(scaled, float("-inf")).scatter(  # every row by its top k (rows they do not hold: below)
        1, order, values.masked_fill(_dropped(mass, probs, limit), float("-inf")))
    held = mass[:, -1] >= limit[:, 0]  # the rows whose nucleus lies within their top k
    if k < scaled.shape[-1] and not bool(held.all()):  # the rest, sorted whole (a row's path is its own)
        whole = (~held).nonzero().squeeze(1)
        sorted_logits, sorted_order = scaled[whole].sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        out[whole] = torch.full_like(sorted_logits, float("-inf")).scatter(1, sorted_order, sorted_logits.masked_fill(
            _dropped(sorted_probs.cumsum(-1), sorted_probs, limit[whole]), float("-inf")))
    return out


def _dropped(mass: torch.Tensor, probs: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Which of a row's tokens, in descending order with their probabilities and running mass, come after tokens
    already reaching ``limit`` (never the first)."""
    drop = (mass - probs) >= limit
    drop[:, 0] = False
    return drop


def top_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]
                 ) -> list[tuple[float, int, dict[int, float]]]:
    """The sampled tokens' log-probabilities under the raw logits, their ranks (vLLM's: how many tokens are at
    least as likely, the token itself included, so 1 is the likeliest), and each row's top-N."""
    logp = logits.log_softmax(-1)  # [N, V]
    chosen_col = logp.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1))
    ranks = (logp >= chosen_col).sum(1).tolist()
    chosen = chosen_col.squeeze(1).tolist()
    out = []
    for i, n in enumerate(num_top):
        top: dict[int, float] = {}
        if n > 0:
            values, ids = logp[i].topk(n)
            top = dict(zip(ids.tolist(), values.tolist()))
        out.append((chosen[i], ranks[i], top))
    return out
