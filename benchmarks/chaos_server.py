"""A soak run against a live ``coserve serve``: clients doing everything at once for a while, then the checks that
nothing broke. The same run against a server in its own process, with the engine loop inspected after, found on
2026-11-27 that every stream closed before its end left its request's final output there for good (600 in a
minute); what this script checks from outside held then too.

Chat clients send chats streamed and not, to the base model, a loaded adapter, fine-tuned models and unknown names;
some leave mid-stream or before the answer. Operation clients upload files, create, cancel, pause and resume jobs,
read their events and checkpoints, delete files and fine-tuned models, and load and unload an adapter. At the end
every job left is cancelled, and the run checks: no 5xx, ``/health`` 200, and the engine idle (no running or
waiting request, no KV block in use, from ``/metrics``). It exits 1 when a check fails.

    coserve serve --model DIR --allow-lora-loading &
    python benchmarks/chaos_server.py --url http://127.0.0.1:8000 --adapter PEFT_DIR [--seconds 90] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time

import httpx

EXAMPLE = (b'{"messages":[{"role":"user","content":"What is two plus two?"},'
           b'{"role":"assistant","content":"Four."}]}\n')


class Chaos:
    def __init__(self, adapter: str) -> None:
        self.adapter = adapter
        self.base = ""  # the base model's name, as /v1/models lists it first
        self.statuses: collections.Counter = collections.Counter()
        self.faults: list[tuple] = []  # 5xx answers and transport errors
        self.files: list[str] = []
        self.jobs: list[str] = []
        self.models: set[str] = set()

    def note(self, label: str, r: httpx.Response) -> None:
        self.statuses[(label, r.status_code)] += 1
        if r.status_code >= 500:
            self.faults.append((label, r.status_code, r.text[:200]))

    async def chat(self, c: httpx.AsyncClient, rnd: random.Random) -> None:
        body = {"model": rnd.choice(["base", "base", "chaos-adapter", "no-such-model", *sorted(self.models)[:3]]),
                "max_tokens": rnd.randint(1, 24), "messages": [{"role": "user", "content": "hi " * rnd.randint(1, 40)}],
                "temperature": rnd.choice([0, 0.7]), "n": rnd.choice([1, 1, 2]), "logprobs": rnd.choice([False, True]),
                "seed": rnd.randint(0, 9)}
        if body["model"] == "base":
            body["model"] = self.base
        if rnd.random() < 0.5:
            async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                self.note("chat, streamed", r)
                async for _ in r.aiter_lines():
                    if rnd.random() < 0.05:  # the client leaves mid-stream
                        break
        elif rnd.random() < 0.1:  # it leaves before the answer
            try:
                await c.post("/v1/chat/completions", json=body, timeout=0.05)
            except httpx.TimeoutException:
                pass
        else:
            self.note("chat", await c.post("/v1/chat/completions", json=body))

    async def operation(self, c: httpx.AsyncClient, rnd: random.Random) -> None:
        op = rnd.random()
        if op < 0.25 or not self.files:
            r = await c.post("/v1/files", files={"file": ("t.jsonl", EXAMPLE * rnd.randint(1, 3)),
                                                 "purpose": (None, "fine-tune")})
            self.note("upload", r)
            if r.status_code == 200:
                self.files.append(r.json()["id"])
        elif op < 0.45:
            r = await c.post("/v1/fine_tuning/jobs", json={
                "model": self.base, "training_file": rnd.choice(self.files),
                "hyperparameters": {"n_epochs": rnd.randint(1, 3)}, "coserve": {"r": 4, "max_steps": rnd.randint(1, 6)}})
            self.note("create job", r)
            if r.status_code == 200:
                self.jobs.append(r.json()["id"])
        elif op < 0.55 and self.jobs:
            self.note("cancel", await c.post(f"/v1/fine_tuning/jobs/{rnd.choice(self.jobs)}/cancel"))
        elif op < 0.62 and self.jobs:
            job = rnd.choice(self.jobs)
            self.note("pause", await c.post(f"/v1/fine_tuning/jobs/{job}/pause"))
            await asyncio.sleep(rnd.random())
            self.note("resume", await c.post(f"/v1/fine_tuning/jobs/{job}/resume"))
        elif op < 0.7 and self.files:
            self.note("delete file", await c.delete(f"/v1/files/{rnd.choice(self.files)}"))
        elif op < 0.8 and self.jobs:
            job = rnd.choice(self.jobs)
            r = await c.get(f"/v1/fine_tuning/jobs/{job}")
            self.note("get job", r)
            if r.status_code == 200 and r.json().get("fine_tuned_model"):
                self.models.add(r.json()["fine_tuned_model"])
            self.note("events", await c.get(f"/v1/fine_tuning/jobs/{job}/events"))
            self.note("checkpoints", await c.get(f"/v1/fine_tuning/jobs/{job}/checkpoints"))
        elif op < 0.87 and self.models:
            self.note("delete model", await c.delete(f"/v1/models/{rnd.choice(sorted(self.models))}"))
        elif op < 0.95:
            self.note("load adapter", await c.post("/v1/load_lora_adapter",
                                                   json={"lora_name": "chaos-adapter", "lora_path": self.adapter}))
            await asyncio.sleep(rnd.random() * 0.5)
            self.note("unload adapter", await c.post("/v1/unload_lora_adapter", json={"lora_name": "chaos-adapter"}))
        else:
            self.note("models", await c.get("/v1/models"))
            self.note("metrics", await c.get("/metrics"))


def gauge(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


async def run(args) -> int:
    chaos = Chaos(args.adapter)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    deadline = time.monotonic() + args.seconds

    async def client(kind: str, seed: int) -> None:
        rnd = random.Random(seed)
        async with httpx.AsyncClient(base_url=args.url, timeout=120, headers=headers) as c:
            while time.monotonic() < deadline:
                try:
                    await (chaos.chat(c, rnd) if kind == "chat" else chaos.operation(c, rnd))
                except httpx.HTTPError as e:
                    chaos.faults.append((kind, repr(e)[:200]))
                await asyncio.sleep(rnd.random() * 0.2)

    async with httpx.AsyncClient(base_url=args.url, timeout=120, headers=headers) as c:
        chaos.base = (await c.get("/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(client("chat", args.seed + i) for i in range(args.chat_clients)),
                             *(client("ops", args.seed + 100 + i) for i in range(args.op_clients)))
        for job in chaos.jobs:  # nothing left running
            await c.post(f"/v1/fine_tuning/jobs/{job}/cancel")
        for _ in range(60):
            metrics = (await c.get("/metrics")).text
            if not gauge(metrics, "coserve_requests_running") and not gauge(metrics, "coserve_requests_waiting"):
                break
            await asyncio.sleep(1)
        health = (await c.get("/health")).status_code
    for (label, status), n in sorted(chaos.statuses.items()):
        print(f"{label:16s} {status}  x{n}")
    idle = {name: gauge(metrics, name) for name in
            ("coserve_requests_running", "coserve_requests_waiting", "coserve_kv_cache_usage")}
    print(f"health {health}; {', '.join(f'{k} {v}' for k, v in idle.items())}; faults {len(chaos.faults)}")
    for fault in chaos.faults[:20]:
        print("FAULT", fault)
    return 0 if health == 200 and not chaos.faults and not any(idle.values()) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--adapter", required=True, help="a PEFT adapter directory the server may load (--allow-lora-loading)")
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--chat-clients", type=int, default=6)
    p.add_argument("--op-clients", type=int, default=3)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
