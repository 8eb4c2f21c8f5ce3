"""Text-similarity scores for the ``text_similarity`` grader (OpenAI's ``evaluation_metric`` names), each in [0, 1].

OpenAI does not publish its definitions; coserve's are the usual ones, each equal to a reference implementation
(the tests compare them):

- ``fuzzy_match``: rapidfuzz's ``fuzz.ratio`` / 100 over characters, ``2 LCS / (len(a) + len(b))`` (the normalized
  Indel similarity); two empty texts score 1.
- ``bleu``: NLTK's ``sentence_bleu`` (up to 4-grams, equal weights, one reference) with its smoothing ``method1``
  (a precision of no match counts 0.1 matches), over :func:`words`.
- ``gleu``: NLTK's ``sentence_gleu`` (Google's sentence GLEU, 1- to 4-grams) over :func:`words`.
- ``rouge_1`` ... ``rouge_5``, ``rouge_l``: Google's ``rouge_score`` F-measure without stemming, over its tokens
  (lower-cased runs of ``a-z0-9``; other characters separate tokens and are dropped).

``meteor`` (it needs WordNet's synonyms) and ``cosine`` (it needs an embedding model) are not computed here.
"""

from __future__ import annotations

import math
import re
from collections import Counter

METRICS = ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
UNSUPPORTED = {"meteor": "it needs WordNet's synonyms", "cosine": "it needs an embedding model"}
_WORD = re.compile(r"\w+|[^\w\s]")
_NOT_ALNUM = re.compile(r"[^a-z0-9]+")
BLEU_EPSILON = 0.1  # NLTK's method1: a precision with no match counts this many matches


def similarity(metric: str, text: str, reference: str) -> float:
    """``metric``'s score of ``text`` against ``reference``; ValueError for a metric not in ``METRICS``."""
    if metric == "fuzzy_match":
        return fuzzy_ratio(text, reference)
    if metric == "bleu":
        return sentence_bleu(words(text), words(reference))
    if metric == "gleu":
        return sentence_gleu(words(text), words(reference))
    if metric == "rouge_l":
        return rouge_l(rouge_tokens(text), rouge_tokens(reference))
    if metric in METRICS:
        return rouge_n(rouge_tokens(text), rouge_tokens(reference), int(metric[-1]))
    why = f" ({UNSUPPORTED[metric]})" if metric in UNSUPPORTED else ""
    raise ValueError(f"evaluation_metric: {metric!r} is not supported{why}; one of {', '.join(METRICS)}")


def words(text: str) -> list[str]:
    """BLEU's and GLEU's tokens: runs of word characters, and each other non-space character on its own."""
    return _WORD.findall(text)


def rouge_tokens(text: str) -> list[str]:
    """``rouge_score``'s default tokens: the text lower-cased, split at every run of characters outside a-z0-9."""
    return [t for t in _NOT_ALNUM.sub(" ", text.lower()).split() if t]


def lcs_length(a: str | list, b: str | list) -> int:
    """The length of a longest common subsequence, bit-parallel (Allison-Dix / Hyyrö): one big-integer step per
    element of ``b``, so long texts cost ``O(len(b) * len(a) / 64)`` word operations."""
    if not a or not b:
        return 0
    masks: dict = {}
    for i, x in enumerate(a):
        masks[x] = masks.get(x, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full  # a 0 bit marks a position of a matched so far
    for y in b:
        m = masks.get(y, 0)
        u = v & m
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def fuzzy_ratio(a: str, b: str) -> float:
    total = len(a) + len(b)
    return 1.0 if total == 0 else 2 * lcs_length(a, b) / total


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu(hypothesis: list[str], reference: list[str], max_n: int = 4) -> float:
    """BLEU of one hypothesis against one reference: the brevity penalty times the geometric mean of the clipped
    n-gram precisions; no unigram in common scores 0, a higher order with none counts ``BLEU_EPSILON``."""
    logs = []
    for n in range(1, max_n + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
        matches = sum(min(c, ref[g]) for g, c in hyp.items())
        total = max(1, sum(hyp.values()))
        if matches == 0:
            if n == 1:
                return 0.0
            logs.append(math.log(BLEU_EPSILON / total))
        else:
            logs.append(math.log(matches / total))
    c, r = len(hypothesis), len(reference)
    penalty = 1.0 if c > r else math.exp(1 - r / c)
    return penalty * math.exp(sum(logs) / max_n)


def sentence_gleu(hypothesis: list[str], reference: list[str], min_n: int = 1, max_n: int = 4) -> float:
    """GLEU: the n-grams of both (all orders from ``min_n`` to ``max_n`` together) in common, over the larger of
    the two's counts (the minimum of precision and recall)."""
    hyp, ref = Counter(), Counter()
    for n in range(min_n, max_n + 1):
        hyp.update(_ngrams(hypothesis, n))
        ref.update(_ngrams(reference, n))
    common = sum((hyp & ref).values())
    most = max(sum(hyp.values()), sum(ref.values()))
    return common / most if most else 0.0


def _f_measure(common: int, predicted: int, target: int) -> float:
    precision, recall = common / max(predicted, 1), common / max(target, 1)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def rouge_n(prediction: list[str], target: list[str], n: int) -> float:
    pred, tgt = _ngrams(prediction, n), _ngrams(target, n)
    return _f_measure(sum((pred & tgt).values()), sum(pred.values()), sum(tgt.values()))


def rouge_l(prediction: list[str], target: list[str]) -> float:
    if not prediction or not target:
        return 0.0
    return _f_measure(lcs_length(target, prediction), len(prediction), len(target))
