"""Typed configurations of the trainable bypass networks (the HF PEFT ``LoraConfig`` / ``IA3Config`` shapes)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from coserve.model.linear_modules import (ALL_LINEAR, ALL_TARGET_MODULES, INPUT_SCALABLE_MODULES,
                                          MIXTRAL_EXPERT_NAMES, ROUTER, V4_EXPERT_NAMES, ExpertShapes, attention_only,
                                          expert_parameter_names, is_router_parameter, resolve_expert_targets,
                                          resolve_targets)
from coserve.model.rank_pattern import check_patterns, expert_targets_from_v4


def _targets(modules) -> list[str]:
    """``target_modules`` as a list; PEFT's ``"all-linear"`` (alone, as a string or a one-item list) kept as
    ``["all-linear"]``: every linear module of the model the adapter is made for (``resolve_targets``)."""
    if isinstance(modules, str):
        if modules != ALL_LINEAR:
            raise ValueError(f"target_modules: a string must be {ALL_LINEAR!r} (PEFT's regular expressions over module "
                             f"paths are not supported); give a list of module names otherwise")
        return [ALL_LINEAR]
    return list(modules)


def _check_targets(name: str, modules: list[str], all_linear: bool = False) -> None:
    if not modules:
        raise ValueError(f"{name}: at least one module is needed")
    if all_linear and modules == [ALL_LINEAR]:
        return
    unknown = sorted(set(modules) - set(ALL_TARGET_MODULES) - set(MIXTRAL_EXPERT_NAMES))
    if unknown:
        raise ValueError(f"{name}: unknown module(s) {unknown}; choose from {', '.join(ALL_TARGET_MODULES)}"
                         + (f" or {ALL_LINEAR!r}" if all_linear else ""))


@dataclass(slots=True)
class LoraConfig:
    """LoRA: ``y = W x + (B A dropout(x)) * scaling``; A Kaiming-uniform, B zeros (PEFT's init)."""

    r: int = 16  # rank
    lora_alpha: float = 16  # scaling numerator
    lora_dropout: float = 0.0  # dropout on the bypass input
    # the papers' setting, down_proj, where neither these nor ``target_parameters`` are named; "all-linear": every
    # linear module of the model (resolved against it: ``resolve_targets``)
    target_modules: list[str] | None = None
    use_rslora: bool = False  # scaling = alpha / sqrt(r) instead of alpha / r
    use_dora: bool = False  # DoRA (PEFT's): a trainable magnitude per output times the direction W + scaling B A
    # a mixture's experts, by PEFT's names: "experts.gate_up_proj", "experts.down_proj" (an A [r, in] and a B [out, r]
    # for each expert of each layer; ``EXPERT_MODULES``)
    target_parameters: list[str] = field(default_factory=list)
    # PEFT's per-module ranks and alphas, by patterns of module paths (``rank_pattern.py``: one scaling per adapter)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"r: must be a positive integer, got {self.r!r}")
        if not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha: must be positive, got {self.lora_alpha!r}")
        if not isinstance(self.use_dora, bool):
            raise ValueError(f"use_dora: must be true or false, got {self.use_dora!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout!r}")
        self.target_parameters = list(self.target_parameters or [])
        if self.target_modules is None:
            self.target_modules = [] if self.target_parameters else ["down_proj"]
        self.target_modules = _targets(self.target_modules)
        if any(is_router_parameter(t) for t in self.target_parameters):  # the router's weight: the module "gate"
            self.target_modules = [*self.target_modules, *([] if ROUTER in self.target_modules else [ROUTER])]
            self.target_parameters = [t for t in self.target_parameters if not is_router_parameter(t)]
        if self.target_modules or not self.target_parameters:
            _check_targets("target_modules", self.target_modules, all_linear=True)
        self.rank_pattern, self.alpha_pattern = dict(self.rank_pattern or {}), dict(self.alpha_pattern or {})
        check_patterns(self.rank_pattern, self.alpha_pattern)
        if self.target_parameters:
            self.target_parameters = expert_parameter_names(self.target_parameters)
            # PEFT's ParamWrapper refuses both: dropout cannot be factored out of a weight's delta, nor DoRA's norm
            if self.lora_dropout:
                raise ValueError(f"lora_dropout: must be 0 with target_parameters (PEFT's adapters of experts take no "
                                 f"dropout), got {self.lora_dropout!r}")
            if self.use_dora:
                raise ValueError("use_dora: DoRA does not adapt experts (target_parameters); PEFT refuses it too")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    @property
    def peft_type(self) -> str:
        return "LORA"


@dataclass(slots=True)
class IA3Config:
    """IA3: learned vectors scaling the outputs of k/v and the input of feed-forward modules (ones at init)."""

    target_modules: list[str] = field(default_factory=lambda: ["k_proj", "v_proj", "down_proj"])
    feedforward_modules: list[str] = field(default_factory=lambda: ["down_proj"])  # input-scaled ones

    def __post_init__(self) -> None:
        self.target_modules = list(self.target_modules)
        self.feedforward_modules = list(self.feedforward_modules)
        _check_targets("target_modules", self.target_modules)
        extra = sorted(set(self.feedforward_modules) - set(self.target_modules))
        if extra:
            raise ValueError(f"feedforward_modules: {extra} are not in target_modules")
        fused = sorted(set(self.feedforward_modules) - set(INPUT_SCALABLE_MODULES))
        if fused:
            raise ValueError(f"feedforward_modules: input scaling of {fused} is not supported "
                             f"(only {', '.join(INPUT_SCALABLE_MODULES)})")

    @property
    def peft_type(self) -> str:
        return "IA3"


def default_targets(peft: str, modules: Iterable[str]) -> dict[str, list[str]]:
    """The fields of a ``peft`` ("lora" or "ia3") config whose modules nobody named, for a model of ``modules``: none
    (the class defaults: LoRA on down_proj, IA3 on k/v/down) where it has down_proj; on a mixture of experts, whose
    MLP takes no adapter, PEFT's defaults for Mixtral within the attention: LoRA on q_proj and v_proj, IA3 on k_proj
    and v_proj (PEFT's also scales the experts' w2, which coserve does not adapt)."""
    if not attention_only(modules):
        return {}
    if peft == "ia3":
        return {"target_modules": ["k_proj", "v_proj"], "feedforward_modules": []}
    return {"target_modules": ["q_proj", "v_proj"]}


def for_model(config: LoraConfig | IA3Config, modules: Iterable[str], experts: ExpertShapes | None = None
              ) -> LoraConfig | IA3Config:
    """``config`` with its ``target_modules`` as the model's own names (``modules``: ``DecoderModel.module_shapes``'
    keys): ``all-linear`` resolved, a module the model lacks refused, naming the field; LoRA's ``target_parameters``
    checked against the model's experts (``DecoderModel.expert_shapes``; None: it has none). On a mixture, LoRA's
    names are read as PEFT 0.21 reads them on transformers 5: ``all-linear`` and transformers 4's names of the experts
    take the experts' parameters (``rank_pattern.expert_targets_from_v4``); on Qwen2-MoE, gate_proj, up_proj and
    down_proj are its shared expert's, and ``all-linear`` the attention and the shared expert."""
    if not isinstance(config, LoraConfig):
        config = replace(config, target_modules=resolve_targets(config.target_modules, modules))
        if ROUTER in config.target_modules:
            raise ValueError(f"target_modules: IA3 of a mixture's router ({ROUTER!r}) makes no adapter PEFT loads "
                             "(PEFT 0.21 adapts the router only with LoRA, as the parameter gate.weight)")
        return config
    names, extra = config.target_modules, {}
    all_linear = names == [ALL_LINEAR]
    if experts is not None and experts.shared_expert:  # Qwen2-MoE: PEFT's names are its shared expert's modules
        names = [m for m in modules if m != ROUTER] if all_linear else [  # PEFT wraps no router there, no expert
            f"shared_expert.{m}" if m in V4_EXPERT_NAMES else m for m in names]
        all_linear = False
    if experts is not None and not experts.shared_expert and experts.v4_names:  # transformers 4's names of the
        # experts, as PEFT reads them (gpt-oss has none, and its all-linear is the attention alone)
        rest, parameters, rank_pattern, alpha_pattern = expert_targets_from_v4(
            [] if all_linear else names, experts.v4_names, config.r, config.lora_alpha, all_linear)
        names = [ALL_LINEAR] if all_linear else rest
        extra = {"rank_pattern": {**rank_pattern, **config.rank_pattern},
                 "alpha_pattern": {**alpha_pattern, **config.alpha_pattern},
                 "target_parameters": list(dict.fromkeys(config.target_parameters + parameters))}
    parameters = resolve_expert_targets(extra.get("target_parameters", config.target_parameters), experts)
    config = replace(config, **{**extra, "target_modules": resolve_targets(names, modules) if names else [],
                                "target_parameters": parameters})
    if ROUTER in config.target_modules and (config.lora_dropout or config.use_dora):
        field = "use_dora" if config.use_dora else "lora_dropout"
        raise ValueError(f"{field}: a mixture's router ({ROUTER!r}) takes LoRA without dropout or DoRA, as PEFT 0.21 "
                         "adapts it (a parameter, gate.weight); leave the router out or drop the option")
    return config
