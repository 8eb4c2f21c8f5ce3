"""What guided decoding costs: the same batch of requests generated free and under JSON and regex guides, in one
process.

    python benchmarks/guided_decoding.py --model DIR [--device cpu] [--requests 16] [--max-tokens 64] [--out FILE]

Each mode runs twice on one engine: the first run pays for building masks of states not seen before (the
vocabulary's bytes and trie are built on the engine's first guided request, also in the first run), the
second finds most of them cached, as a server does after its first requests with a schema. Reported: output
tokens per second, the ratio to free text of --max-tokens tokens, and the ratio to free text of the very same
output lengths run right after (what the guide itself costs), and how many of the guided outputs parse as JSON matching
their schema by ``jsonschema`` (or, for a regex, match it by ``re.fullmatch``; those that end before
``--max-tokens``; the rest are cut by it, as free text would be); the grammar mode's texts are checked as
JSON objects (its grammar writes a subset of them), and so are the lark mode's (the same grammar in Lark's syntax).
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
GRAMMARS = {"grammar": """root ::= "{" pair ("," " "? pair){0,3} "}"
pair ::= key ":" " "? value
key ::= "\\"" [a-z]{1,8} "\\""
value ::= [0-9]{1,4} | "true" | "false" | key""",
            # the same language in Lark's syntax (coserve/guided/lark.py): what the other front end costs
            "lark": r"""start: "{" pair ("," " "? pair) ~ 0..3 "}"
pair: key ":" " "? value
key: "\"" /[a-z]{1,8}/ "\""
value: /[0-9]{1,4}/ | "true" | "false" | key"""}


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
    for mode in ("free", *SCHEMAS, *REGEXES, *GRAMMARS):
        schema, regex, grammar = SCHEMAS.get(mode), REGEXES.get(mode), GRAMMARS.get(mode)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=0, guided_json=schema,
                                guided_regex=regex, guided_grammar=grammar,
                                ignore_eos=schema is None and regex is None and grammar is None)
        for attempt in ("first", "again"):
            seconds, outs = run(llm, prompts, params)
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
            valid = sum(bool(re.fullmatch(regex, t, re.ASCII)) if regex else
                        _parses(t) if grammar else _matches(t, schema) for t in ended)
            # free text of the very same lengths, right after: what the outputs cost without a guide (guided
            # outputs that end early spend more of their time on the prompt, so tokens/s alone would mislead)
            same, _ = run(llm, prompts, [SamplingParams(max_tokens=n, temperature=0.8, seed=0, ignore_eos=True)
                                         for n in lengths])
            rows.append({"mode": mode, "run": attempt, "seconds": seconds, "output_tokens": sum(lengths),
                         "tokens_per_s": sum(lengths) / seconds, "free_same_lengths_seconds": same,
                         "ratio_to_free_same_lengths": same / seconds, "ended": len(ended), "valid_json": valid})
    free = next(r["tokens_per_s"] for r in rows if r["mode"] == "free" and r["run"] == "again")
    print(f"{'mode':<12} {'run':<6} {'tok/s':>8} {'vs free':>8} {'vs free, same lengths':>22} {'ended':>6} {'valid':>6}")
    for r in rows:
        r["ratio_to_free"] = r["tokens_per_s"] / free
        print(f"{r['mode']:<12} {r['run']:<6} {r['tokens_per_s']:>8.0f} {r['ratio_to_free']:>7.2f}x "
              f"{r['ratio_to_free_same_lengths']:>21.2f}x {r['ended']:>6} {r['valid_json']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": args.device, "requests": args.requests,
                       "max_tokens": args.max_tokens, "rows": rows}, f, indent=2)


def _parses(text: str) -> bool:
    """Whether the grammar mode's text is a JSON object (what its grammar describes, a subset of JSON)."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


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
