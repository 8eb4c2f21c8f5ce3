"""``coserve finetune``: train a LoRA or IA3 adapter on a dataset file with token-level windows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import FinetuneJob
from coserve.finetune.memory import autograd_saved_bytes, peak_rss_bytes
from coserve.finetune.runner import run_job
from coserve.model.loader import load_model, resolve_device, resolve_dtype
from coserve.model.config import ModelConfig
from coserve.model.tokenizer import load_tokenizer
from coserve.output_path import prepare_directory
from coserve.peft.config import IA3Config, LoraConfig, default_targets
from coserve.finetune.build import load_training, make_bypass, new_job, starting_bypass
from coserve.peft.trainable import TrainableBypass, load_model_trainable


def add_arguments(p) -> None:
    d = FinetuneConfig(output_dir="-")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSON or JSONL: {text}, Alpaca, or OpenAI chat records (with "
                   "--method dpo: preference pairs, OpenAI's DPO records or TRL's prompt/chosen/rejected)")
    p.add_argument("--method", default=d.method, choices=["sft", "dpo", "simpo", "orpo", "grpo"],
                   help="sft: cross-entropy on the completions; on preference pairs: dpo (Direct Preference "
                        "Optimization against the base model, or --dpo-reference), simpo or orpo (no reference); "
                        "grpo: on prompts, completions sampled and scored by --reward functions")
    p.add_argument("--reward", action="append", default=[], metavar="MODULE:FUNC",
                   help="grpo: a reward function, f(prompts, completions, **fields) -> rewards, as TRL calls it: "
                        "an importable module's or a .py file's function, or FILE.json: one of OpenAI's graders "
                        "(string_check, text_similarity, python, multi, and score_model/label_model graded by the "
                        "base model, named by its directory; the record's fields are its item) (repeat "
                        "for several; they are summed)")
    p.add_argument("--reward-weight", action="append", type=float, default=[], metavar="W",
                   help="grpo: one weight per --reward, in order (default 1 each)")
    p.add_argument("--num-generations", type=int, default=d.num_generations,
                   help="grpo: completions per prompt (batch-size * grad-accum must be whole groups of them)")
    p.add_argument("--max-completion-tokens", type=int, default=d.max_completion_tokens)
    p.add_argument("--eval-samples", type=int, default=d.eval_samples,
                   help="grpo with --validation-data: completions sampled per validation prompt")
    p.add_argument("--temperature", type=float, default=d.temperature, help="grpo: sampling temperature")
    p.add_argument("--grpo-loss", default=d.grpo_loss, choices=["dapo", "grpo", "bnpo", "dr_grpo"],
                   help="grpo: TRL's loss_type (how token losses are normalised)")
    p.add_argument("--scale-rewards", default=d.scale_rewards, choices=["group", "batch", "none"],
                   help="grpo: divide advantages by the group's or the batch's reward spread, or not")
    p.add_argument("--dpo-beta", type=float, default=d.dpo_beta,
                   help="the preference methods' beta (DPO's, SimPO's; ORPO's weight of the odds-ratio loss)")
    p.add_argument("--simpo-gamma", type=float, default=d.simpo_gamma, help="SimPO's target reward margin")
    p.add_argument("--dpo-loss", default=d.dpo_loss, choices=["sigmoid", "hinge", "ipo"],
                   help="TRL's loss_type (--method dpo): sigmoid (DPO), hinge (SLiC) or ipo (IPO)")
    p.add_argument("--dpo-label-smoothing", type=float, default=d.dpo_label_smoothing,
                   help="sigmoid loss: the chance a preference is flipped (cDPO), in [0, 0.5)")
    p.add_argument("--dpo-reference", default=d.dpo_reference, metavar="DIR",
                   help="an adapter directory as DPO's frozen reference; the job trains a copy of it (its --peft "
                        "and --lora-* options are the adapter's), or resumes --init-adapter against it")
    p.add_argument("--save-steps", type=int, default=0, help="every this many steps, a resumable checkpoint in "
                   "OUTPUT/checkpoint-STEP (HF Trainer's layout; --init-adapter resumes from one); 0 = only the end")
    p.add_argument("--save-total-limit", type=int, default=0, help="keep only the newest this many checkpoint-STEP "
                   "directories (0 = all)")
    p.add_argument("--eval-steps", type=int, default=0,
                   help="with --validation-data: a validation batch (batch-size examples, chosen by the step, so "
                        "a resume picks the same) every this many steps; 0 = only the whole set after each epoch "
                        "(grpo: the whole set sampled and rewarded every this many steps, and after the last)")
    p.add_argument("--validation-data", default=None, metavar="FILE",
                   help="same formats; its mean loss per target token is logged (valid_loss) after every epoch "
                        "and the last step (grpo: prompts, whose mean reward is logged, valid_reward)")
    p.add_argument("--output", required=True, help="adapter directory (HF PEFT format) and training_log.jsonl")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--init-adapter", default=None, help="start from (resume) this adapter and its optimizer state")
    start.add_argument("--start-adapter", default=d.start_adapter, metavar="DIR",
                   help="train on from this finished adapter's weights with a fresh optimizer and schedule (its "
                        "--peft and --lora-* options are the adapter's)")
    p.add_argument("--peft", default="lora", choices=["lora", "ia3"])
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--use-rslora", action="store_true")
    p.add_argument("--use-dora", action="store_true", help="DoRA (PEFT's use_dora): a trainable magnitude per output")
    p.add_argument("--target-modules", default=None, help="comma-separated, or all-linear as in PEFT (lora "
                   "default: down_proj; ia3 default: k_proj,v_proj,down_proj)")
    p.add_argument("--target-parameters", default=None, help="a mixture's experts, comma-separated, as PEFT's "
                   "target_parameters (lora): experts.gate_up_proj,experts.down_proj")
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lr-scheduler", default=d.lr_scheduler, choices=["constant", "linear", "cosine"])
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="0 = off")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="0 = as the epochs give")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--train-on-prompt", action="store_true")
    windows = p.add_mutually_exclusive_group()
    windows.add_argument("--window-tokens", type=int, default=0, help="window size; 0 = whole sequences")
    windows.add_argument("--window-schedule", default="", help="random:SEED")
    p.add_argument("--rematerialize", default=d.rematerialize, choices=["cheap", "all"])
    p.add_argument("--memory-target", type=float, default=d.memory_target,
                   help="cheap: keep at most this fraction of the pruned keep set's bytes, recomputing the "
                        "projections or attention that cost the fewest FLOPs (1 = recompute only the cheap tensors)")
    p.add_argument("--memory-report", default=None, metavar="FILE.json")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    prepare_directory("--output", args.output)  # before any training
    cfg = FinetuneConfig(
        output_dir=args.output, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, lr=args.lr, optimizer=args.optimizer, lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        max_seq_len=args.max_seq_len, seed=args.seed, shuffle=not args.no_shuffle,
        window_tokens=args.window_tokens, window_schedule=args.window_schedule,
        rematerialize=args.rematerialize, memory_target=args.memory_target,
        train_on_prompt=args.train_on_prompt, eval_steps=args.eval_steps, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, method=args.method, dpo_beta=args.dpo_beta,
        dpo_loss=args.dpo_loss, dpo_label_smoothing=args.dpo_label_smoothing, dpo_reference=args.dpo_reference,
        start_adapter=args.start_adapter, simpo_gamma=args.simpo_gamma, num_generations=args.num_generations,
        max_completion_tokens=args.max_completion_tokens, temperature=args.temperature, grpo_loss=args.grpo_loss,
        scale_rewards=args.scale_rewards, eval_samples=args.eval_samples)
    if cfg.method == "grpo":
        return _grpo(args, cfg)
    if args.reward or args.reward_weight:
        raise ValueError(f"--reward: reward functions are for --method grpo, not {cfg.method}")
    model_cfg = ModelConfig.from_dir(args.model)
    tokenizer = load_tokenizer(args.model)
    examples, report = load_training(args.data, tokenizer, cfg)
    print(report.summary())
    validation = None
    if args.validation_data:
        validation, vreport = load_training(args.validation_data, tokenizer, cfg)
        print(f"validation: {vreport.summary()}")
    device = resolve_device(args.device)
    # RoPE positions for every training position, also past the checkpoint's nominal context.
    model = load_model(args.model, resolve_dtype(args.dtype, model_cfg), device,
                       max_positions=max(model_cfg.max_position_embeddings, cfg.max_seq_len))
    bypass = _bypass(args, model, device, cfg)
    job = new_job(model, bypass, examples, cfg, base_model=str(Path(args.model).resolve()),
                  resume_from=Path(args.init_adapter) if args.init_adapter else None, validation=validation)
    run_job(job, progress=not args.no_progress)
    last = job.log[-1] if job.log else None
    print(f"trained {job.step} steps; last loss {last.loss:.4f}; adapter in {cfg.output_dir}" if last
          else f"nothing to train; adapter in {cfg.output_dir}")
    if args.memory_report:
        _memory_report(args.memory_report, job, job.examples)
    return 0


def _bypass(args, model, device: torch.device, cfg: FinetuneConfig) -> TrainableBypass:
    if args.init_adapter:
        return load_model_trainable(args.init_adapter, model)
    if cfg.start_adapter or cfg.dpo_reference:
        return starting_bypass(None, model, cfg)
    return make_bypass(_peft_config(args, model.module_shapes()), model, cfg.seed)


def _peft_config(args, modules) -> LoraConfig | IA3Config:
    """``--peft`` and its options; with no ``--target-modules``, the model's defaults (``default_targets``)."""
    targets = args.target_modules.split(",") if args.target_modules else None
    experts = args.target_parameters.split(",") if args.target_parameters else []
    if args.peft == "ia3":
        if experts:
            raise ValueError("--target-parameters: only LoRA adapts experts (as PEFT's IA3 does not)")
        return IA3Config(**({"target_modules": targets,
                             "feedforward_modules": [m for m in targets if m == "down_proj"]} if targets
                            else default_targets("ia3", modules)))
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      use_rslora=args.use_rslora, use_dora=args.use_dora, target_parameters=experts,
                      **({"target_modules": targets} if targets else default_targets("lora", modules)))


def load_reward(spec: str, judge=None):
    """``MODULE:FUNC`` (an importable module) or ``FILE.py:FUNC``: the function; ``FILE.json``: an OpenAI grader as
    one (``judge`` runs a model grader's calls); errors name ``--reward``."""
    import importlib
    import importlib.util
    if spec.endswith(".json"):
        return _grader_reward(Path(spec), judge)
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--reward: expected MODULE:FUNC or FILE.py:FUNC, got {spec!r}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"--reward: {where} is not a file")
            module_spec = importlib.util.spec_from_file_location(f"coserve_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # the user's module failed to import: its own error, named
        raise ValueError(f"--reward: cannot load {where} ({type(e).__name__}: {e})") from e
    func = getattr(module, name, None)
    if not callable(func):
        raise ValueError(f"--reward: {where} has no function {name!r}")
    return func


def _grader_reward(path: Path, judge):
    from coserve.finetune.graders import grader_reward, parse_grader
    try:
        spec = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"--reward: cannot read {path} ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"--reward: {path} is not JSON ({e})") from None
    try:
        return grader_reward(parse_grader(spec), judge)
    except ValueError as e:
        raise ValueError(f"--reward: {path}: {e}") from None


def _grpo(args, cfg: FinetuneConfig) -> int:
    """GRPO through the Python API's engine (the rollouts need inference); progress a line a step."""
    from coserve.engine.chat_judge import llm_judge
    from coserve.engine.llm import LLM
    engine_judge = []  # model graders are graded by the model being trained's engine, once it is loaded
    funcs = [load_reward(spec, lambda calls: engine_judge[0](calls)) for spec in args.reward]
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    engine_judge.append(llm_judge(llm))
    peft = None if cfg.start_adapter or args.init_adapter else _peft_config(args, llm.engine.model.module_shapes())
    handle = llm.finetune(args.data, peft=peft, config=cfg, reward_funcs=funcs,
                          reward_weights=args.reward_weight or None, resume_from=args.init_adapter,
                          validation=args.validation_data)
    print(handle.data_report)
    shown = 0
    while handle.status()["status"] == "running":
        handle.wait(0.5)
        for record in handle.log[shown:]:
            if not args.no_progress:
                valid = f", validation reward {record['valid_reward']:.4f}" if "valid_reward" in record else ""
                print(f"step {record['step']}: reward {record['reward']:.4f} (std {record['reward_std']:.4f}), "
                      f"completions {record['completions_mean_length']:.1f} tokens{valid}", flush=True)
            shown += 1
    status = handle.status()
    if status["status"] != "succeeded":
        print(f"coserve finetune: stopped: {status['error']}", file=sys.stderr)
        return 1
    print(f"trained {status['step']} steps; last reward {status['reward']:.4f}; adapter in {cfg.output_dir}")
    return 0


def _memory_report(path: str, job: FinetuneJob, examples) -> None:
    sample = max(examples, key=lambda e: len(e.token_ids))
    autograd = autograd_saved_bytes(job.model, job.bypass, sample.token_ids, sample.targets)
    plan = job.plan
    report = {
        "kept_bytes_per_token": plan.model_kept_bytes_per_token,
        "keep_all_bytes_per_token": plan.model_keep_all_bytes_per_token,
        "executor_kept_bytes_per_token": job.kept_bytes_per_token,
        "autograd_bytes_per_token": autograd / len(sample.token_ids),
        "peak_rss_bytes": peak_rss_bytes(),
        "rematerialize": job.cfg.rematerialize,
        "measured_on_tokens": len(sample.token_ids),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"memory report: {path}")
