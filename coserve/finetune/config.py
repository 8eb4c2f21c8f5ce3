"""Finetuning job options (the same for ``coserve finetune`` and ``LLM.finetune``), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.finetune.graph_pruning import DEFAULT_MEMORY_TARGET

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULERS = ("constant", "linear", "cosine")
REMATERIALIZE = ("cheap", "all")
METHODS = ("sft", "dpo", "simpo", "orpo", "grpo")  # supervised (cross-entropy on the completions), a preference
#   method, or GRPO (online: completions the model samples, scored by reward functions; grpo.py)
PREFERENCE_METHODS = ("dpo", "simpo", "orpo")  # on preference pairs (preference_job.py); simpo and orpo need no
#   reference model
DPO_LOSSES = ("sigmoid", "hinge", "ipo")  # TRL's loss_type names (preference_job.dpo_terms)
GRPO_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo")  # TRL GRPOTrainer's loss_type names (grpo.sequence_scales)
SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards: advantages divided by the group's or the batch's
#   reward standard deviation, or not


@dataclass(slots=True)
class FinetuneConfig:
    """How to train one adapter; errors name the field."""

    output_dir: str  # where the adapter, optimizer state and training_log.jsonl go
    epochs: int = 1  # passes over the data (ignored once max_steps is reached)
    max_steps: int = 0  # optimizer steps at most; 0 = as many as the epochs give
    batch_size: int = 1  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4  # peak learning rate
    optimizer: str = "adamw"  # adamw (torch defaults for betas and eps) or sgd
    lr_scheduler: str = "linear"  # constant, linear or cosine decay to 0 after warm-up
    warmup_steps: int = 0  # linear warm-up from 0
    weight_decay: float = 0.0  # decoupled (AdamW) or L2 (SGD)
    max_grad_norm: float = 1.0  # global gradient-norm clipping; 0 = off
    max_seq_len: int = 1024  # longer examples are truncated (and counted)
    seed: int = 0  # data order and adapter initialisation
    shuffle: bool = True  # shuffle the examples every epoch
    window_tokens: int = 0  # forward and backward window size; 0 = whole sequences
    window_schedule: str = ""  # "random:SEED": random window sizes (exactness checks)
    rematerialize: str = "cheap"  # cheap: keep what the graph-pruning plan keeps; all: layer inputs and K/V only
    memory_target: float = DEFAULT_MEMORY_TARGET  # cheap: the kept bytes' ceiling as a fraction of the pruned keep
    #   set's; the plan recomputes the projections (or attention) costing the fewest FLOPs to get there (1 = none)
    max_nonfinite_steps: int = 3  # consecutive steps with a non-finite loss before the job stops
    eval_steps: int = 0  # with validation data: every this many steps (0 = never), the next batch_size validation
    #   examples (in turn) run forward-only for the step's valid_batch_loss (the whole set runs at each epoch's end);
    #   GRPO: the whole validation set is sampled and rewarded every this many steps (0 = each epoch's end) and after
    #   the last
    eval_samples: int = 1  # GRPO: completions sampled per validation prompt
    guided_json: dict | bool | None = None  # GRPO: a JSON schema every completion (rollouts, validation) must match
    #   (OpenAI's reinforcement response_format; a grader reads the output as sample.output_json)
    train_on_prompt: bool = False  # loss on prompt tokens too (Alpaca and chat formats)
    save_steps: int = 0  # HF Trainer's: every this many steps, a resumable checkpoint in output_dir/checkpoint-STEP
    save_total_limit: int = 0  # HF Trainer's: keep only the newest this many of those (0 = all)
    method: str = "sft"  # sft, or on preference pairs (preference.py): dpo (Direct Preference Optimization, the base
    #   model, the adapter off, as the reference), simpo (SimPO: no reference, per-token mean log-probabilities and a
    #   margin gamma; TRL's CPOTrainer with loss_type simpo and cpo_alpha 0) or orpo (ORPO: the chosen completions'
    #   cross-entropy plus beta times an odds-ratio loss, no reference; TRL's ORPOTrainer)
    dpo_beta: float = 0.1  # the preference methods' beta: DPO's and SimPO's (how sharp the preference) and ORPO's
    #   weight of the odds-ratio loss (its lambda); TRL's and OpenAI's default
    dpo_loss: str = "sigmoid"  # DPO's, TRL's loss_type: sigmoid (DPO), hinge (SLiC) or ipo (IPO, on per-token means)
    dpo_label_smoothing: float = 0.0  # sigmoid DPO and SimPO: the chance a pair's preference is flipped, in [0, 0.5)
    simpo_gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)
    dpo_reference: str = ""  # an adapter directory (HF PEFT) as DPO's reference, frozen, and where a new job's adapter
    #   starts (DPO after supervised finetuning, as TRL runs an SFT adapter as both); "" = the base model
    start_adapter: str = ""  # an adapter directory (HF PEFT) whose weights a new job trains on from (a copy; its PEFT
    #   config decides), with a fresh optimizer and schedule: more training of a finished adapter, as OpenAI
    #   fine-tunes a fine-tuned model. "" = a fresh adapter (or dpo_reference's copy)
    # GRPO (method grpo; TRL's GRPOConfig names and defaults): a step samples batch_size * grad_accum completions,
    # num_generations for each of its prompts
    num_generations: int = 8  # completions sampled per prompt (a group: advantages are relative to it)
    max_completion_tokens: int = 512  # TRL's max_completion_length (its default, TRL 1.16)
    temperature: float = 1.0  # the completions' sampling temperature
    grpo_loss: str = "dapo"  # TRL's loss_type: how the token losses are normalised (grpo.sequence_scales)
    scale_rewards: str = "group"  # TRL's scale_rewards

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "grad_accum", "max_seq_len", "max_nonfinite_steps"):
            _positive_int(name, getattr(self, name))
        for name in ("max_steps", "warmup_steps", "window_tokens", "seed", "eval_steps", "save_steps",
                     "save_total_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr: must be positive, got {self.lr!r}")
        for name in ("weight_decay", "max_grad_norm"):
            if not isinstance(getattr(self, name), (int, float)) or not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.memory_target, (int, float)) or not 0 < self.memory_target <= 1:
            raise ValueError(f"memory_target: must be in (0, 1], got {self.memory_target!r}")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _choice("rematerialize", self.rematerialize, REMATERIALIZE)
        if self.window_schedule and not _is_random_schedule(self.window_schedule):
            raise ValueError(f"window_schedule: expected 'random:SEED', got {self.window_schedule!r}")
        if self.window_schedule and self.window_tokens:
            raise ValueError("window_schedule: give either window_tokens or window_schedule, not both")
        _choice("method", self.method, METHODS)
        if (not isinstance(self.dpo_beta, (int, float)) or isinstance(self.dpo_beta, bool)
                or not 0 < self.dpo_beta < float("inf")):
            raise ValueError(f"dpo_beta: must be a positive number, got {self.dpo_beta!r}")
        _choice("dpo_loss", self.dpo_loss, DPO_LOSSES)
        eps = self.dpo_label_smoothing
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < 0.5:
            raise ValueError(f"dpo_label_smoothing: must be in [0, 0.5), got {eps!r}")
        if eps and self.dpo_loss != "sigmoid":
            raise ValueError(f"dpo_label_smoothing: only the sigmoid loss smooths labels (dpo_loss is {self.dpo_loss})")
        if eps and self.method == "orpo":
            raise ValueError("dpo_label_smoothing: ORPO's odds-ratio loss has no label smoothing")
        if self.dpo_loss != "sigmoid" and self.method != "dpo":
            raise ValueError(f"dpo_loss: {self.dpo_loss} is a DPO loss; method {self.method} has its own")
        gamma = self.simpo_gamma
        if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or not 0 <= gamma < float("inf"):
            raise ValueError(f"simpo_gamma: must be a non-negative number, got {gamma!r}")
        if not isinstance(self.dpo_reference, str):
            raise ValueError(f"dpo_reference: must be an adapter directory's path, got {self.dpo_reference!r}")
        if not isinstance(self.start_adapter, str):
            raise ValueError(f"start_adapter: must be an adapter directory's path, got {self.start_adapter!r}")
        if self.dpo_reference and self.method != "dpo":
            raise ValueError("dpo_reference: a reference adapter is for method dpo")
        if self.method in PREFERENCE_METHODS and self.train_on_prompt:
            raise ValueError(f"train_on_prompt: {self.method} compares the completions' log-probabilities; the prompt "
                             "carries no loss")
        _positive_int("num_generations", self.num_generations)
        _positive_int("eval_samples", self.eval_samples)
        if self.guided_json is not None and not isinstance(self.guided_json, (dict, bool)):
            raise ValueError(f"guided_json: expected a JSON schema (an object), got {self.guided_json!r}")
        if self.guided_json is not None and self.method != "grpo":
            raise ValueError(f"guided_json: a schema for sampled completions is for method grpo, not {self.method}")
        _positive_int("max_completion_tokens", self.max_completion_tokens)
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0 < self.temperature < float("inf")):
            raise ValueError(f"temperature: must be a positive number, got {self.temperature!r}")
        _choice("grpo_loss", self.grpo_loss, GRPO_LOSSES)
        _choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        if self.method == "grpo":
            completions = self.batch_size * self.grad_accum
            if completions % self.num_generations:
                raise ValueError(f"num_generations: a step's batch_size * grad_accum = {completions} completions must "
                                 f"be whole groups of {self.num_generations} (TRL's rule)")
            if self.num_generations < 2 and self.scale_rewards != "none":
                raise ValueError("num_generations: a group of one completion has no reward spread to scale by (give "
                                 "2 or more, or scale_rewards none)")
            if self.train_on_prompt:
                raise ValueError("train_on_prompt: GRPO's loss is on the sampled completions only")
        if not self.output_dir:
            raise ValueError("output_dir: is required")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")


def _is_random_schedule(spec: object) -> bool:
    if not isinstance(spec, str):
        return False
    kind, _, seed = spec.partition(":")
    return kind == "random" and seed.isdigit()
