"""What grading costs: coserve's text-similarity metrics against their reference implementations (rapidfuzz, NLTK,
Google's rouge_score: the test extras), on the same text pairs, and a python grader's process per batch.

    python benchmarks/graders.py [--pairs 20] [--words 400]

Each timing is the best of three passes over the pairs, per pair; the python grader is timed on batches of 1, 64
and 512 samples (one process a batch).
"""

from __future__ import annotations

import argparse
import random
import time

from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from rapidfuzz import fuzz
from rouge_score import rouge_scorer

from coserve.finetune import text_similarity as ts
from coserve.finetune.graders import make_sample, parse_grader

WORDS = "the of and to in is that for it as with was on be by this are or from at an which".split()


def best_ms(fn, count: int, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) / count * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--words", type=int, default=400)
    args = p.parse_args()
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    pairs = [(text(args.words), text(args.words)) for _ in range(args.pairs)]
    smooth, scorer = SmoothingFunction().method1, rouge_scorer.RougeScorer(["rougeL"])
    peers = {"fuzzy_match": lambda a, b: fuzz.ratio(a, b),
             "bleu": lambda a, b: sentence_bleu([ts.words(b)], ts.words(a), smoothing_function=smooth),
             "rouge_l": lambda a, b: scorer.score(b, a)}
    print(f"per pair of {args.words}-word texts: coserve ms, reference ms")
    for metric, peer in peers.items():
        ours = best_ms(lambda: [ts.similarity(metric, a, b) for a, b in pairs], len(pairs))
        theirs = best_ms(lambda: [peer(a, b) for a, b in pairs], len(pairs))
        print(f"{metric:12s} {ours:8.3f} {theirs:8.3f}")
    grader = parse_grader({"type": "python", "name": "contains",
                           "source": "def grade(sample, item):\n    return float(item['a'] in sample['output_text'])\n"})
    for n in (1, 64, 512):
        samples, items = [make_sample(text(50)) for _ in range(n)], [{"a": "the"}] * n
        print(f"python grader, a batch of {n}: {best_ms(lambda: grader.grade(samples, items), 1):.1f} ms")


if __name__ == "__main__":
    main()
