"""``coserve run-batch -i IN.jsonl -o OUT.jsonl --model DIR``: an OpenAI batch file run offline (vLLM's
``run-batch``), through the server's own routes in-process, without a port: one output line per request, in
the input's order (replies and errors alike, as vLLM writes them), written atomically."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

from coserve.output_path import prepare_output
from coserve.server import serve_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True, help="JSONL of OpenAI batch requests "
                   '({"custom_id", "method": "POST", "url", "body"} per line)')
    p.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL)")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in the engine at once")
    serve_command.add_arguments(p)
    p.set_defaults(state_dir=None, log_level="warning")


def run(args: argparse.Namespace) -> int:
    from coserve.server.app import build_app
    from coserve.server.batch_files import parse_batch_jsonl
    from coserve.server.store import write_atomically

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = Path(args.input_file)
    try:
        data = source.read_bytes()
    except OSError as e:
        raise ValueError(f"--input-file: cannot read {source} ({e.strerror})") from e
    try:
        lines = parse_batch_jsonl(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    if args.max_concurrency <= 0:
        raise ValueError(f"--max-concurrency: must be positive, got {args.max_concurrency}")
    out = prepare_output("--output-file", args.output_file)  # before the batch runs: its answers would be lost
    with tempfile.TemporaryDirectory(prefix="coserve-run-batch-") as scratch:
        if args.state_dir is None:  # nothing of this run outlives it
            args.state_dir = scratch
        config, engine_config = serve_command.configs(args, warn_without_keys=False)
        app = build_app(config, engine_config)
        records = asyncio.run(_run_all(app, lines, args.max_concurrency, engine_config.scheduling_policy))
    write_atomically(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    ok = sum(r["response"]["status_code"] < 300 for r in records)
    print(f"coserve run-batch: {len(records)} requests, {ok} answered, {len(records) - ok} errors -> "
          f"{args.output_file}", flush=True)
    return 0


async def _run_all(app, lines, concurrency: int, scheduling_policy: str) -> list[dict]:
    from coserve.server.auth import DEFAULT_TENANT
    from coserve.server.batches import BATCH_PRIORITY, run_request

    slots = asyncio.Semaphore(concurrency)
    priority = BATCH_PRIORITY if scheduling_policy == "priority" else None
    async with app.router.lifespan_context(app):
        return list(await asyncio.gather(*(run_request(app, DEFAULT_TENANT, line, slots, priority)
                                           for line in lines)))


if __name__ == "__main__":
    from coserve.cli import main
    sys.exit(main(["run-batch", *sys.argv[1:]]))
