"""What a streamed tool call costs the server per update: one long call in each ``--tool-call-parser`` format, fed
to its stream reader (``ToolCallStream``) as a model would write it, a few characters per token.

    python benchmarks/tool_stream_cost.py [--lines 3000] [--piece 4] [--parser NAME ...] [--out FILE]

The call writes ``--lines`` lines of code into one string argument (about 6 characters each); every ``--piece``
characters the reader is given the text so far, as the server gives it the output at each token. Reported per
format: the call's characters, the updates, the seconds in all and the microseconds per update. The reader re-reads
the text at each update, so a scan in Python per character grows with the square of the call's length; the
scanners find their markers with ``str.find`` and ``json``'s C scanner instead.
"""

from __future__ import annotations

import argparse
import json
import time

from coserve.server.tool_parser import PARSERS, parse_tool_calls
from coserve.server.tool_stream import ToolCallStream


def call_text(parser: str, code: str) -> str:
    """One call of ``write(code=...)`` as ``parser``'s models write it."""
    args = json.dumps({"code": code})
    texts = {
        "hermes": f'<tool_call>{{"name": "write", "arguments": {args}}}</tool_call>',
        "llama3_json": f'{{"name": "write", "parameters": {args}}}',
        "pythonic": f"[write(code={code!r})]",
        "llama4_pythonic": f"<|python_start|>[write(code={code!r})]<|python_end|>",
        "llama4_json": f'{{"name": "write", "parameters": {args}}}',
        "phi4_mini_json": f'functools[{{"name": "write", "arguments": {args}}}]',
        "olmo3": f"<function_calls>\nwrite(code={code!r})\n</function_calls>",
        "mistral": f"[TOOL_CALLS]write[ARGS]{args}",
        "granite": f'<tool_call>[{{"name": "write", "arguments": {args}}}]',
        "qwen3_coder": (f"<tool_call>\n<function=write>\n<parameter=code>\n{code}</parameter>\n</function>\n"
                        "</tool_call>"),
        "seed_oss": (f"<seed:tool_call>\n<function=write>\n<parameter=code>\n{code}</parameter>\n</function>\n"
                     "</seed:tool_call>"),
        "glm45": f"<tool_call>write\n<arg_key>code</arg_key>\n<arg_value>{code}</arg_value>\n</tool_call>",
        "minimax_m2": ('<minimax:tool_call>\n<invoke name="write">\n<parameter name="code">'
                       f"{code}</parameter>\n</invoke>\n</minimax:tool_call>"),
        "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>write\n```json\n"
                        f"{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        "deepseek_v31": (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>write<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"
                         "<｜tool▁calls▁end｜>"),
        "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.write:0<|tool_call_argument_begin|>"
                    f"{args}<|tool_call_end|><|tool_calls_section_end|>"),
    }
    return texts[parser]


def measure(parser: str, text: str, piece: int) -> dict:
    _, calls = parse_tool_calls(text, parser)
    if [c.name for c in calls] != ["write"]:
        raise SystemExit(f"{parser}: the benchmark's text is not one call of write")
    stream, updates = ToolCallStream(True, parser), 0
    started = time.perf_counter()
    for at in range(piece, len(text) + piece, piece):
        stream.update(text[:at])
        updates += 1
    seconds = time.perf_counter() - started
    if stream.broken:
        raise SystemExit(f"{parser}: the stream reader gave up on the call")
    return {"parser": parser, "chars": len(text), "updates": updates, "seconds": round(seconds, 4),
            "us_per_update": round(seconds / updates * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=3000)
    p.add_argument("--piece", type=int, default=4, help="characters per update (about a token's)")
    p.add_argument("--parser", action="append", choices=PARSERS, help="the formats (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    code = "x = (1)\n" * args.lines
    rows = [measure(parser, call_text(parser, code), args.piece) for parser in args.parser or PARSERS]
    for row in rows:
        print(f"{row['parser']:>13}: {row['chars']} chars, {row['updates']} updates, {row['seconds']:.3f} s, "
              f"{row['us_per_update']:.1f} us/update")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
