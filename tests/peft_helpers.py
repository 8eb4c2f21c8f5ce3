"""Making real HF PEFT adapters for tests (random non-zero B so that they change outputs)."""

from __future__ import annotations

from pathlib import Path

import torch


def lora_adapters_per_model(tmp_path_factory, name: str, specs: dict[str, dict]):
    """``get(model_dir) -> {adapter name: directory}``: the LoRA adapters ``specs`` names (``make_lora_adapter``'s
    arguments each), made once per model under a directory called ``name``."""
    made: dict = {}

    def get(model_dir):
        if model_dir not in made:
            root = tmp_path_factory.mktemp(name)
            made[model_dir] = {key: make_lora_adapter(model_dir, root / key, **kw) for key, kw in specs.items()}
        return made[model_dir]

    return get


def make_lora_adapter(model_dir: Path, out_dir: Path, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter of ``model_dir`` with both A and B random; returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(out_dir))
    return out_dir


def make_dora_adapter(model_dir: Path, out_dir: Path, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT DoRA adapter with random B and magnitudes moved away from the base weights' norms."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(use_dora=True, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_model(model_dir: Path, adapter_dir: Path):
    """The HF PEFT oracle: a fresh base model with the adapter applied."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def make_ia3_adapter(model_dir: Path, out_dir: Path, seed: int = 0, **ia3_kwargs) -> Path:
    """Save a PEFT IA3 adapter of ``model_dir`` with vectors moved away from ones; returns ``out_dir``."""
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, IA3Config(task_type="CAUSAL_LM", **ia3_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ia3_l" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(str(out_dir))
    return out_dir


def make_coserve_ia3_adapter(model_dir: Path, out_dir: Path, seed: int = 0, **ia3_kwargs) -> Path:
    """Save an IA3 adapter made by coserve's ``TrainableIA3`` (vectors moved away from ones); returns ``out_dir``."""
    from coserve.model.loader import load_model
    from coserve.peft.config import IA3Config
    from coserve.peft.trainable import TrainableIA3
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    bypass = TrainableIA3(IA3Config(**ia3_kwargs), model.module_shapes(), model.cfg.num_layers, model.device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bypass.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    bypass.save_pretrained(out_dir, base_model=str(model_dir))
    return out_dir


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` from a transformers (or PEFT) model's ``generate``."""
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_mixed_batch_matches_peft(model_dir: Path, base_oracle, paths: dict, which: list, prompts: list[str],
                                   n: int) -> None:
    """One ``LLM.generate`` batch of ``prompts``, each on its adapter of ``which`` (names of ``paths``, None: the base
    model), chunked prefill of 11 tokens: each request's ``n`` greedy tokens are its PEFT oracle's (``base_oracle``
    for the base), and at least two adapted requests differ from the base's."""
    from coserve import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=11)
    for name, path in paths.items():
        llm.load_adapter(name, path)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), adapter=which)
    oracles = {None: base_oracle, **{name: peft_model(model_dir, p) for name, p in paths.items()}}
    differs = 0
    for out, name in zip(outs, which):
        assert out.token_ids == hf_greedy(oracles[name], out.prompt_token_ids, n), (name, out.prompt)
        if name is not None:
            differs += out.token_ids != hf_greedy(oracles[None], out.prompt_token_ids, n)
    assert differs >= 2, "the adapters should change the outputs"


class PeftTraining:
    """HF PEFT trained in a plain torch loop, the oracle of coserve's optimizer steps: the adapter loaded trainable,
    SGD or AdamW and a linear warm-up schedule as ``cfg`` (a ``FinetuneConfig``) has them for ``steps`` steps."""

    def __init__(self, model_dir: Path, adapter_dir: Path, cfg, steps: int) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        kind = torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.AdamW
        self.opt = kind(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = get_linear_schedule_with_warmup(self.opt, cfg.warmup_steps, steps)
        self.max_grad_norm = cfg.max_grad_norm

    def step(self, loss: torch.Tensor) -> float:
        """One optimizer step on ``loss`` (clipped, then scheduled); returns the loss."""
        loss.backward()
        if self.max_grad_norm:  # 0: no clipping, as FinetuneConfig has it
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        return loss.item()

    def state(self) -> dict[str, torch.Tensor]:
        """The trained adapter's tensors under the names PEFT saves them with."""
        return {n.replace(".default", "").replace("magnitude_vector.weight", "magnitude_vector"): p.detach()
                for n, p in self.model.named_parameters() if p.requires_grad}


def make_v4_expert_adapter(model_dir: Path, out_dir: Path, names: tuple[str, ...], block: str, rank: int = 2,
                           seed: int = 0, router: bool = False) -> Path:
    """A LoRA adapter of a mixture's experts in transformers 4's layout, one LoRA per expert module
    (``...layers.<i>.<block>.experts.<e>.<name>.lora_A.weight``; Mixtral's ``block`` is ``block_sparse_moe``, its
    ``names`` w1/w3/w2), with q_proj (and the router, ``router``) beside them: what PEFT wrote before transformers 5,
    and PEFT 0.21 converts on loading. Written by hand (transformers 4 is not installed), random A and B."""
    import json

    from safetensors.torch import save_file
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h = cfg["hidden_size"]
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (h, i), "w3": (h, i), "w2": (i, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    tensors = {}

    def lora(prefix: str, fan_in: int, fan_out: int) -> None:
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.3

    for layer in range(cfg["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{layer}"
        heads = cfg["num_attention_heads"]
        lora(f"{p}.self_attn.q_proj", h, heads * (cfg.get("head_dim") or h // heads))
        if router:
            lora(f"{p}.{block}.gate", h, experts)
        for e in range(experts):
            for name in names:
                lora(f"{p}.{block}.experts.{e}.{name}", *shapes[name])
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "base_model_name_or_path": str(model_dir),
        "target_modules": ["q_proj", *names, *(["gate"] if router else [])]}))
    return out_dir
