"""What grading costs: coserve's text-similarity metrics against their reference implementations (rapidfuzz, NLTK,
Google's rouge_score: the test extras), on the same text pairs, a python grader's process per batch, and with
``--model DIR`` a label_model grader on that model through the engine against the same conversations as plain
``LLM.chat`` calls with the same guide (what the grading layer adds to the model's work).

    python benchmarks/graders.py [--pairs 20] [--words 400] [--model models/coserve-small --samples 32]

Each timing is the best of three passes over the pairs, per pair; the python grader is timed on batches of 1, 64
and 512 samples (one process a batch); the model grader on one batch of ``--samples`` samples.
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
    p.add_argument("--model", default=None, help="a model directory: also time a label_model grader on it")
    p.add_argument("--samples", type=int, default=32)
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
    if args.model:
        model_grader(args.model, [make_sample(text(30)) for _ in range(args.samples)])


def model_grader(model_dir: str, samples: list[dict]) -> None:
    """A label_model grader's batch through ``llm_judge`` against the same conversations through ``LLM.chat``."""
    from pathlib import Path

    from coserve import LLM, SamplingParams
    from coserve.engine.chat_judge import llm_judge
    llm = LLM(model_dir)
    labels = ["good", "bad", "unsure"]
    grader = parse_grader({"type": "label_model", "name": "judge", "model": Path(model_dir).name, "labels": labels,
                           "passing_labels": ["good"], "input": [{"role": "user", "content":
                                                                  "Is this a good answer? {{ sample.output_text }}"}]})
    judge, items = llm_judge(llm), [{}] * len(samples)
    conversations = [[{"role": "user", "content": f"Is this a good answer? {x['output_text']}"}] for x in samples]
    params = SamplingParams(temperature=0, max_tokens=64, guided_choice=labels)
    grader.grade(samples, items, judge)  # warm: the guide's tables, the kernels
    ours = best_ms(lambda: grader.grade(samples, items, judge), len(samples))
    plain = best_ms(lambda: llm.chat(conversations, params), len(samples))
    scores = grader.grade(samples, items, judge)[0]
    said = [o.outputs[0].text for o in llm.chat(conversations, params)]
    assert scores == [float(x == "good") for x in said], "the grader and the chat calls disagree"
    print(f"label_model grader on {Path(model_dir).name}, a batch of {len(samples)}: {ours:.2f} ms a sample "
          f"through the grader, {plain:.2f} ms as plain LLM.chat calls ({ours / plain:.2f}x)")


if __name__ == "__main__":
    main()
