"""What guided decoding costs: the same batch of requests generated free and under JSON and regex guides, in one
process.

    python benchmarks/guided_decoding.py --model DIR [--device cpu] [--requests 16] [--max-tokens 64] [--out FILE]

Each mode runs twice on one engine: the first run pays for building masks of states not seen before (the
vocabulary's bytes and trie are built on the engine's first guided request, also in the first run), the
second finds most of them cached, as a server does after its first requests with a schema. Reported: output
tokens per second and the ratio to free text, and how many of the guided outputs parse as JSON matching
their schema by ``jsonschema`` (or, for a regex, match it by ``re.fullmatch``; those that end before
``--max-tokens``; the rest are cut by it, as free text would be).
"""

from __future__ import annotations

import argparse
import json
import re
import time

from coserve import LLM, SamplingParams

SCHEMAS = {
    "json_object": {"type": "object"},
    "record": {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tags"],
               "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                              "n": {"type": "integer"},
                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
    "patterned": {"type": "object", "additionalProperties": False, "required": ["sku", "email"],
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
                                 "email": {"type": "string", "pattern": "^[a-z0-9.]{1,12}@[a-z]{1,8}\\.(com|org)$"}}},
}
REGEXES = {"regex": r"(\d{3}-){2}\d{4}|[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10}){0,3}\."}


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args()
    llm = LLM(args.model, dtype="float32", device=args.device)
    prompts = [f"Request {i}: describe item {i} as JSON." for i in range(args.requests)]
    rows = []
    for mode in ("free", *SCHEMAS, *REGEXES):
        schema, regex = SCHEMAS.get(mode), REGEXES.get(mode)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=0, guided_json=schema,
                                guided_regex=regex, ignore_eos=schema is None and regex is None)
        for attempt in ("first", "again"):
            seconds, outs = run(llm, prompts, params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
            valid = sum(bool(re.fullmatch(regex, t, re.ASCII)) if regex else _matches(t, schema) for t in ended)
            rows.append({"mode": mode, "run": attempt, "seconds": seconds, "output_tokens": tokens,
                         "tokens_per_s": tokens / seconds, "ended": len(ended), "valid_json": valid})
    free = next(r["tokens_per_s"] for r in rows if r["mode"] == "free" and r["run"] == "again")
    print(f"{'mode':<12} {'run':<6} {'tok/s':>8} {'vs free':>8} {'ended':>6} {'valid':>6}")
    for r in rows:
        r["ratio_to_free"] = r["tokens_per_s"] / free
        print(f"{r['mode']:<12} {r['run']:<6} {r['tokens_per_s']:>8.0f} {r['ratio_to_free']:>7.2f}x "
              f"{r['ended']:>6} {r['valid_json']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": args.device, "requests": args.requests,
                       "max_tokens": args.max_tokens, "rows": rows}, f, indent=2)


def _matches(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON that ``jsonschema`` (a test dependency) finds valid against ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    main()
