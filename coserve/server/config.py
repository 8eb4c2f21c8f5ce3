"""The server's configuration (``coserve serve`` flags), validated once; errors name the flag."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from coserve.server import reasoning
from coserve.server.tool_parser import PARSERS

LOOPBACK_NAMES = ("localhost",)
# While serving, the interpreter's GIL switch interval (sys.setswitchinterval; Python's default is 5 ms): how long the
# event loop may wait for the engine thread to hand it the GIL. On a 2-core CPU 0.5 ms took about 4 ms off the HTTP
# path's median TTFT in 200-request load runs and made no difference in 500-request ones (docs/benchmark-history.md).
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.5


@dataclass(slots=True)
class ServerConfig:
    """Everything the HTTP layer needs beyond the engine's own configuration."""

    model: str  # the base model directory
    state_dir: str  # SQLite state, uploaded files, adapters and checkpoints
    served_model_name: str = ""  # the base model's name in the API; "" = the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty = no authentication
    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT adapter directory (LoRA or IA3), served to every tenant
    allow_lora_loading: bool = False  # POST /v1/load_lora_adapter (vLLM's runtime LoRA loading)
    python_graders: bool = False  # run callers' python graders (their code, in a process of its own each batch)
    max_body_bytes: int = 4 * 2**20  # JSON request bodies
    max_upload_bytes: int = 64 * 2**20  # POST /v1/files, and a part of an upload (OpenAI's part limit)
    max_file_bytes: int = 512 * 2**20  # a file an upload makes of its parts (read whole to be validated)
    max_waiting_requests: int = 512  # requests queued in the engine before new ones get 503
    max_queued_jobs: int = 16  # per tenant: queued or running fine-tuning jobs before new ones get 429
    max_running_jobs: int = 2  # fine-tuning jobs co-served at once (more wait, queued)
    max_loaded_models: int = 32  # fine-tuned models and checkpoints kept loaded (least recently used unloaded)
    checkpoint_steps: int = 0  # save a servable checkpoint every N optimizer steps; 0 = at each epoch's end
    stream_interval: int = 1  # streamed responses: an event every this many tokens (the first token at once)
    gil_switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS  # while serving (below)
    tool_call_parser: str | None = None  # tool_choice "auto": how calls written in the text are read (tool_parser.py)
    reasoning_parser: str | None = None  # chat replies' reasoning, <think>...</think>, apart from their content

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_upload_bytes", "max_file_bytes", "max_waiting_requests", "max_queued_jobs",
                     "max_running_jobs", "max_loaded_models", "stream_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be a positive integer, got {value!r}")
        if not (isinstance(self.gil_switch_interval_ms, (int, float)) and 0 < self.gil_switch_interval_ms <= 1000):
            raise ValueError(f"--gil-switch-interval-ms: must be a number of milliseconds in (0, 1000], got "
                             f"{self.gil_switch_interval_ms!r}")
        if not isinstance(self.checkpoint_steps, int) or self.checkpoint_steps < 0:
            raise ValueError(f"--checkpoint-steps: must be a non-negative integer, got {self.checkpoint_steps!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port: {self.port} is not a TCP port")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser: must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"--reasoning-parser: must be one of {', '.join(reasoning.PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        for name in self.adapters:
            if name.startswith("ft:") or not name:
                raise ValueError(f"--adapter: the name {name!r} is empty or starts with 'ft:' (kept for fine-tuned models)")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (only this machine can connect)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
