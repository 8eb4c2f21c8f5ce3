"""Which model a request's ``model`` names: the base, a PEFT adapter (LoRA or IA3) served to all, or a tenant's fine-tuned
model or checkpoint, its own or one another tenant shared with it (loaded into the engine on first use)."""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from pathlib import Path

from coserve.engine.engine_loop import EngineLoop
from coserve.peft import AdapterError
from coserve.server.errors import APIError, not_found
from coserve.server.generation import on_engine_async
from coserve.server.store import Store

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_JOB_ID = re.compile(r"ftjob-[0-9a-f]{24}")


def fine_tuned_name(base: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's form: ``ft:<base>:<suffix>:<job id>``."""
    return f"ft:{base}:{suffix or ''}:{job_id}"


def checkpoint_name(fine_tuned: str, step: int) -> str:
    return f"{fine_tuned}:ckpt-step-{step}"


async def load_adapter(loop: EngineLoop, name: str, path: Path) -> None:
    """Read and check the adapter on a worker thread, then install it between two iterations: the engine thread
    does not wait for the disk."""
    adapter = await asyncio.to_thread(loop.engine.read_adapter, name, path)
    await on_engine_async(loop, lambda: loop.engine.install_adapter(adapter))


class ModelRegistry:
    """Names to engine adapters, per tenant."""

    def __init__(self, base: str, loop: EngineLoop, store: Store, state_dir: Path, max_loaded: int = 32) -> None:
        self.base = base
        self.loop = loop
        self.store = store
        self.state_dir = state_dir
        self.shared: dict[str, float] = {}  # adapter name -> created (served to every tenant)
        self.started = int(time.time())
        self.max_loaded = max_loaded  # fine-tuned models and checkpoints kept loaded in the engine at most
        self.loaded: OrderedDict[str, None] = OrderedDict()  # those loaded, least recently used first
        self._loading: dict[str, asyncio.Future] = {}  # name -> its load in progress (requests share it)
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs (resolve_blocking)

    async def resolve(self, tenant: str, name: str, param: str = "model") -> str | None:
        """The engine adapter for ``name`` (None for the base model); 404 when the tenant may not use it."""
        if name == self.base:
            return None
        if name in self.shared:
            return name
        path = self.fine_tuned_path(tenant, name)
        if path is None:
            raise not_found("model", name, param)
        if name not in self.loop.engine.adapters:
            loading = self._loading.get(name)
            if loading is None:
                loading = self._loading[name] = asyncio.ensure_future(load_adapter(self.loop, name, path))
                loading.add_done_callback(lambda _: self._loading.pop(name, None))
            try:
                await asyncio.shield(loading)  # a client that leaves does not cancel the others' load
            except AdapterError as e:
                raise APIError(400, f"The model '{name}' cannot be served: {e}", param, "model_not_servable") from e
        self.loaded[name] = None
        self.loaded.move_to_end(name)
        if len(self.loaded) > self.max_loaded:
            await on_engine_async(self.loop, lambda: self._evict(keep=name))
        return name

    def servable(self, tenant: str, name: str) -> bool:
        """Whether ``resolve`` would serve ``name`` to the tenant (it may still have to load it)."""
        return name == self.base or name in self.shared or self.fine_tuned_path(tenant, name) is not None

    def resolve_blocking(self, tenant: str, name: str, timeout_s: float = 300.0) -> str | None:
        """``resolve`` from a thread other than the event loop's (a model grader's, in a job or a grader run):
        LookupError when the tenant may not use ``name`` or it cannot be served."""
        if self.event_loop is None:
            raise LookupError("the server is not running")
        try:
            return asyncio.run_coroutine_threadsafe(self.resolve(tenant, name), self.event_loop).result(timeout_s)
        except APIError as e:
            raise LookupError(e.message) from None

    def _evict(self, keep: str) -> str | None:
        """On the engine thread: unload the least recently used fine-tuned model no request is using."""
        for old in list(self.loaded):
            if old == keep:
                continue
            try:
                self.loop.engine.unload_adapter(old)
            except AdapterError:  # in use by a request (or already gone): try the next
                if old not in self.loop.engine.adapters:
                    del self.loaded[old]
                continue
            del self.loaded[old]
            return old
        return None

    def fine_tuned_path(self, tenant: str, name: str) -> Path | None:
        """Where the fine-tuned model or checkpoint ``name`` the tenant may use lies (its own, or one another tenant
        shared with it while its owner still has it), or None."""
        usable = self._usable(tenant, name)
        return usable[1] if usable is not None else None

    def owner(self, tenant: str, name: str) -> str | None:
        """The tenant owning the fine-tuned model or checkpoint ``name`` that ``tenant`` may use, or None."""
        usable = self._usable(tenant, name)
        return usable[0] if usable is not None else None

    def _usable(self, tenant: str, name: str) -> tuple[str, Path] | None:
        """``(owner, path)`` of the fine-tuned model or checkpoint ``name`` the tenant may use, or None."""
        own = self.owned_path(tenant, name)
        if own is not None:
            return tenant, own
        sharer = self.store.sharer(name, tenant) if name.startswith("ft:") else None
        path = self.owned_path(sharer, name) if sharer is not None else None
        return (sharer, path) if path is not None else None

    def owned_path(self, tenant: str, name: str) -> Path | None:
        """Where the tenant's own fine-tuned model or checkpoint ``name`` lies, or None if it is not theirs."""
        if not name.startswith("ft:"):
            return None
        found = self.store.checkpoint_by_model(name)
        if found is not None:
            job_id, path = found
            return Path(path) if self.store.job_tenant(job_id) == tenant else None
        job_id = name.rsplit(":", 1)[-1]
        if not _JOB_ID.fullmatch(job_id):
            return None
        job = self.store.get_job(tenant, job_id)
        if (job is None or job.get("status") != "succeeded" or job.get("fine_tuned_model") != name
                or job.get("coserve", {}).get("model_deleted")):
            return None
        return self.state_dir / "jobs" / job_id / "model"

    async def delete(self, tenant: str, name: str) -> dict:
        """``DELETE /v1/models/{name}``: the tenant's fine-tuned model is no longer served (requests already
        running on it finish) or listed; its job and checkpoints stay, files included (the last checkpoint is the
        same adapter). 404 unless it is the tenant's; 403 for the base, shared adapters and checkpoints."""
        if name == self.base or name in self.shared:
            raise APIError(403, f"The model '{name}' cannot be deleted", "model", "model_not_deletable")
        if self.fine_tuned_path(tenant, name) is not None and self.owned_path(tenant, name) is None:
            raise APIError(403, f"The model '{name}' was shared with you: only its owner can delete it", "model",
                           "model_not_deletable")
        path = self.owned_path(tenant, name)
        if path is None:
            raise not_found("model", name, "model")
        if self.store.checkpoint_by_model(name) is not None:
            raise APIError(403, f"The model '{name}' is a checkpoint: it stays with its job", "model",
                           "model_not_deletable")
        job_id = name.rsplit(":", 1)[-1]
        job = self.store.get_job(tenant, job_id)
        self.store.update_job(job_id, coserve={**job.get("coserve", {}), "model_deleted": True})
        await on_engine_async(self.loop, lambda: self._unload(name))
        return {"id": name, "object": "model", "deleted": True}

    def _unload(self, name: str) -> None:
        """On the engine thread: unload ``name`` now, or, while requests still use it, first at the next eviction."""
        if name not in self.loop.engine.adapters:
            self.loaded.pop(name, None)
            return
        try:
            self.loop.engine.unload_adapter(name)
            self.loaded.pop(name, None)
        except AdapterError:
            self.loaded[name] = None
            self.loaded.move_to_end(name, last=False)

    def describe(self, tenant: str, name: str) -> dict | None:
        """``GET /v1/models/{name}``: the model object if the tenant may use ``name`` (checkpoints included)."""
        for entry in self.listing(tenant):
            if entry["id"] == name:
                return entry
        owner = self.owner(tenant, name)
        if owner is None:
            return None
        found = self.store.checkpoint_by_model(name)  # a checkpoint of one of the owner's jobs
        job = self.store.get_job(owner, found[0]) if found else None
        return self._entry(name, job["created_at"] if job else self.started, owner, self.base)

    def add_shared(self, name: str) -> None:
        self.shared[name] = int(time.time())

    def listing(self, tenant: str) -> list[dict]:
        """``GET /v1/models``: the base, shared adapters, the tenant's fine-tuned models, and the fine-tuned models
        and checkpoints other tenants shared with it (``owned_by`` theirs)."""
        data = [self._entry(self.base, self.started, "coserve", None)]
        for name, created in sorted(self.shared.items()):
            data.append(self._entry(name, created, "coserve", self.base))
        for owner, job in self.store.jobs_with_status("succeeded"):
            if owner == tenant and job.get("fine_tuned_model") and not job.get("coserve", {}).get("model_deleted"):
                data.append(self._entry(job["fine_tuned_model"], job.get("finished_at"), tenant, self.base))
        for name, owner, created in self.store.shared_with(tenant):
            if self.owned_path(owner, name) is not None:
                data.append(self._entry(name, created, owner, self.base))
        return data

    def _entry(self, name: str, created: int | None, owned_by: str, parent: str | None) -> dict:
        """A model object: OpenAI's fields, and vLLM's ``root``, ``parent`` and ``max_model_len`` (the context every
        model here shares, the base's)."""
        return {"id": name, "object": "model", "created": created, "owned_by": owned_by, "root": name,
                "parent": parent, "max_model_len": self.loop.engine.max_model_len}
