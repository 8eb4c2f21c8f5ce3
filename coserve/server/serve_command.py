"""``coserve serve``: the OpenAI-compatible server for inference and fine-tuning jobs."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from coserve.engine.config import FUSE_CHOICES
from coserve.engine.slo_options import add_slo_arguments, slo_settings
from coserve.output_path import prepare_directory
from coserve.server.config import DEFAULT_GIL_SWITCH_INTERVAL_MS
from coserve.server import reasoning
from coserve.server.tool_parser import PARSERS

DEFAULT_STATE_DIR = "coserve-state"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--served-model-name", default="", help="the base model's name in the API (default: the "
                   "directory's name)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT adapter (LoRA or IA3) every tenant may use (repeatable)")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="SPEC",
                   help="vLLM's form of --adapter: NAME=PATH or a JSON object {\"name\": ..., \"path\": ...}, "
                        "one or more")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="one key; its tenant is 'default'")
    keys.add_argument("--api-keys", default=None, metavar="FILE", help="one 'KEY TENANT' per line")
    p.add_argument("--no-auth", action="store_true", help="serve without keys on a non-loopback host")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="SQLite state, files, adapters and checkpoints")
    add_slo_arguments(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--finetune-memory-gb", type=float, default=None)
    p.add_argument("--policy", default="coserve", help="how finetuning shares iterations (see coserve bench)")
    p.add_argument("--latency-model", default=None, help="a `coserve profile` JSON (default: the user's profile)")
    p.add_argument("--fuse-finetuning", default="auto", choices=FUSE_CHOICES,
                   help="finetuning forward windows in the inference rows' matmul calls (auto: where that cannot "
                        "change an inference output)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode iterations launch their kernels one by one (as vLLM's flag)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="a model whose sliding layers sit beside whole-context ones (Gemma 2 and 3) keeps their K/V "
                        "in the main KV blocks rather than in a smaller pool of their own (as vLLM's flag)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share full KV blocks among requests with the same prefix (tenant and adapter too); "
                        "--no-enable-prefix-caching computes every prompt whole (as vLLM's flag)")
    p.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                   help="speculative decoding by n-gram lookup: up to K draft tokens verified per decode step of a "
                        "greedy request (vLLM's ngram method); 0 = off")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="which waiting request goes first: fcfs, or priority (requests' 'priority', lower first; "
                        "batch requests default to 1, behind interactive ones at 0) (as vLLM's flag)")
    p.add_argument("--allow-lora-loading", action="store_true", help="enable POST /v1/load_lora_adapter")
    p.add_argument("--python-graders", action="store_true",
                   help="run python graders (grader runs and reinforcement fine-tuning): callers' code, each batch in "
                        "an isolated Python process with a time limit, shut off from the network and from this "
                        "user's files where the kernel allows it (a network namespace, Landlock); off by default")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default with tools): read the calls a model writes in its "
                        "text with --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=list(PARSERS), default=None,
                   help="the format of tool calls in the text (hermes: <tool_call>{json}</tool_call> after any text; "
                        "llama3_json: a reply of {\"name\", \"parameters\"} objects separated by ;, pythonic: a reply "
                        "[f(a=1), g(b='x')] (llama4_pythonic: also in <|python_start|>; llama4_json: as llama3_json), "
                        "phi4_mini_json: functools[{\"name\", \"arguments\"}, ...], olmo3: <function_calls> then a "
                        "call a line, mistral: [TOOL_CALLS]f[ARGS]{...} "
                        "or [TOOL_CALLS][{\"name\", \"arguments\"}, ...] after any text, granite: the array after "
                        "any <tool_call>, qwen3_coder: "
                        "<tool_call><function=f><parameter=a>1</parameter></function></tool_call> after any text, "
                        "seed_oss: the same in <seed:tool_call>, glm45: <tool_call>f<arg_key>a</arg_key>"
                        "<arg_value>1</arg_value></tool_call> after any text, minimax_m2: <invoke name=f>"
                        "<parameter name=a>1</parameter></invoke> in <minimax:tool_call> blocks; deepseek_v3, "
                        "deepseek_v31, kimi_k2: their sections of marker tokens after any text)")
    p.add_argument("--reasoning-parser", choices=list(reasoning.PARSERS), default=None,
                   help="chat replies carry the model's reasoning (<think>...</think>; seed_oss: "
                        "<seed:think>...</seed:think>; mistral: [THINK]...[/THINK]) as reasoning_content, apart "
                        "from the content; structured outputs constrain the content only (vLLM's flag)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument("--max-upload-bytes", type=int, default=64 * 2**20,
                   help="a POST /v1/files body, and a part of an upload (POST /v1/uploads/{id}/parts)")
    p.add_argument("--max-file-bytes", type=int, default=512 * 2**20,
                   help="a file the Uploads API makes of its parts")
    p.add_argument("--max-waiting-requests", type=int, default=512)
    p.add_argument("--stream-interval", type=int, default=1, help="streamed responses: the first token at once, "
                   "then an event every N tokens (fewer events take less CPU from the engine; vLLM's flag)")
    p.add_argument("--gil-switch-interval-ms", type=float, default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
                   help="while serving, the interpreter's GIL switch interval: how long the event loop may wait "
                        "for the engine thread (Python's default: 5)")
    p.add_argument("--max-queued-jobs", type=int, default=16, help="per tenant")
    p.add_argument("--max-running-jobs", type=int, default=2)
    p.add_argument("--max-loaded-models", type=int, default=32, help="fine-tuned models and checkpoints kept "
                   "loaded in the engine (the least recently used is unloaded)")
    p.add_argument("--checkpoint-steps", type=int, default=0, help="0 = a checkpoint at each epoch's end")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from coserve.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, engine_config = configs(args)
    app = build_app(config, engine_config)
    name = app.state.coserve.models.base
    base = f"http://{args.host}:{args.port}/v1"
    key = "YOUR_KEY" if config.api_keys else "none"
    header = ' -H "Authorization: Bearer YOUR_KEY"' if config.api_keys else ""
    client = (f"from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='{key}'); "
              f"print(c.chat.completions.create(model='{name}', max_tokens=32, "
              f"messages=[{{'role': 'user', 'content': 'Hello'}}]).choices[0].message.content)")
    print(f"coserve: serving {name} at {base} (state in {args.state_dir})\n"
          f"  curl {base}/models{header}\n  python -c \"{client}\"", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def served_adapters(adapter: list[str], lora_modules: list[str]) -> dict[str, str]:
    """``name -> path`` from ``--adapter NAME=PATH`` and vLLM's ``--lora-modules`` (``NAME=PATH`` or JSON with
    ``name`` and ``path``); ValueError naming the flag for a malformed one or a name given twice."""
    adapters: dict[str, str] = {}
    for flag, specs in (("--adapter", adapter), ("--lora-modules", lora_modules)):
        for spec in specs:
            if flag == "--lora-modules" and spec.lstrip().startswith("{"):
                try:
                    entry = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--lora-modules: {spec!r} is not JSON ({e})") from None
                name, path = (entry.get("name"), entry.get("path")) if isinstance(entry, dict) else (None, None)
                if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
                    raise ValueError(f'--lora-modules: expected {{"name": ..., "path": ...}}, got {spec!r}')
            else:
                name, sep, path = spec.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"{flag}: expected NAME=PATH, got {spec!r}")
            if name in adapters:
                raise ValueError(f"{flag}: the adapter name {name!r} is given twice")
            adapters[name] = path
    return adapters


def configs(args: argparse.Namespace, warn_without_keys: bool = True):
    """``(ServerConfig, EngineConfig)`` from the flags; ValueError naming a bad one."""
    from coserve.engine.config import EngineConfig
    from coserve.server.auth import DEFAULT_TENANT, load_keys_file
    from coserve.server.config import ServerConfig, is_loopback

    log = logging.getLogger("coserve.server")
    keys = load_keys_file(args.api_keys) if args.api_keys else {args.api_key: DEFAULT_TENANT} if args.api_key else {}
    if not keys:
        if not is_loopback(args.host) and not args.no_auth:
            raise ValueError(f"--host: {args.host} is reachable from other machines; give --api-key or --api-keys "
                             "(or --no-auth to serve without keys)")
        if warn_without_keys:
            log.warning("serving without API keys: anyone who can reach %s:%d may use it", args.host, args.port)
    adapters = served_adapters(args.adapter, args.lora_modules)
    prepare_directory("--state-dir", args.state_dir)  # before the model loads
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice: give it together with --tool-call-parser (as vLLM's flags)")
    config = ServerConfig(model=args.model, state_dir=args.state_dir, served_model_name=args.served_model_name,
                          host=args.host, port=args.port, api_keys=keys, adapters=adapters,
                          allow_lora_loading=args.allow_lora_loading, python_graders=args.python_graders,
                          max_body_bytes=args.max_body_bytes,
                          max_upload_bytes=args.max_upload_bytes, max_file_bytes=args.max_file_bytes,
                          max_waiting_requests=args.max_waiting_requests,
                          max_queued_jobs=args.max_queued_jobs, max_running_jobs=args.max_running_jobs,
                          max_loaded_models=args.max_loaded_models, stream_interval=args.stream_interval,
                          gil_switch_interval_ms=args.gil_switch_interval_ms,
                          checkpoint_steps=args.checkpoint_steps, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser)
    engine_config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 max_model_len=args.max_model_len, kv_cache_memory_gb=args.kv_cache_memory_gb,
                                 max_lora_rank=args.max_lora_rank, max_loras=args.max_loras, policy=args.policy,
                                 **slo_settings(args), latency_model=args.latency_model,
                                 finetune_memory_gb=args.finetune_memory_gb, fuse_finetuning=args.fuse_finetuning,
                                 cuda_graphs=not args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
                                 speculative_tokens=args.speculative_ngram,
                                 disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                                 scheduling_policy=args.scheduling_policy)
    return config, engine_config


if __name__ == "__main__":
    from coserve.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
