"""A new job's parts from its configuration: the trainable bypass from a PEFT config, the training data and the
job for its method (shared by ``coserve finetune``, ``LLM.finetune`` and the server)."""

from __future__ import annotations

import torch

from coserve.finetune.config import PREFERENCE_METHODS, FinetuneConfig
from coserve.finetune.dataset import DatasetReport, load_dataset
from coserve.finetune.job import FinetuneJob
from coserve.finetune.preference import load_preference_dataset
from coserve.finetune.preference_job import PreferenceJob
from coserve.model.decoder import DecoderModel
from coserve.model.linear_modules import resolve_targets
from coserve.peft.config import IA3Config, LoraConfig, default_targets
from coserve.peft.trainable import TrainableBypass, TrainableIA3, TrainableLora, load_model_trainable


def make_bypass(peft: LoraConfig | IA3Config, model: DecoderModel, seed: int) -> TrainableBypass:
    """LoRA (PEFT's initialisation, drawn from ``seed``) or IA3 (ones) over ``model``'s modules."""
    shapes, layers = model.module_shapes(), model.cfg.num_layers
    if isinstance(peft, IA3Config):
        return TrainableIA3(peft, shapes, layers, model.device)
    if isinstance(peft, LoraConfig):
        try:
            return TrainableLora(peft, shapes, layers, model.device, torch.Generator().manual_seed(seed),
                                 base_weight=model.module_weight if peft.use_dora else None,
                                 experts=model.expert_shapes())
        except (RuntimeError, TypeError, OverflowError) as e:
            if isinstance(e, RuntimeError) and not _allocation_failed(e):
                raise  # not the rank's size: a fault of its own, reported as it is
            targets = resolve_targets(peft.target_modules, shapes)
            params = layers * sum(peft.r * sum(shapes[m]) for m in targets)
            raise ValueError(f"r: a rank-{peft.r} LoRA on {', '.join(targets)} has {params:,} "
                             f"parameters, which cannot be allocated ({type(e).__name__})") from e
    raise ValueError(f"peft: expected a LoraConfig or IA3Config, got {type(peft).__name__}")


def _allocation_failed(error: RuntimeError) -> bool:
    """Whether torch could not make a tensor that large (out of memory, or a size past its arithmetic)."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "allocat" in text or "overflow" in text


def starting_bypass(peft: LoraConfig | IA3Config | None, model: DecoderModel,
                    cfg: FinetuneConfig) -> TrainableBypass:
    """A new job's trainable bypass: ``peft``'s fresh one (LoRA r=16 on down_proj by default), or a trainable copy
    of ``cfg.start_adapter`` (else, for DPO on a reference adapter, of that one): ``peft`` must then be None, the
    adapter's own config decides."""
    source = cfg.start_adapter or cfg.dpo_reference
    if source:
        if peft is not None:
            field = "start_adapter" if cfg.start_adapter else "dpo_reference"
            raise ValueError(f"peft: a job from an adapter ({field}) trains a copy of that adapter (give no peft "
                             "config)")
        return load_model_trainable(source, model)
    return make_bypass(peft or LoraConfig(**default_targets("lora", model.module_shapes())), model, cfg.seed)


def load_training(path, tokenizer, cfg: FinetuneConfig) -> tuple[list, DatasetReport]:
    """A data file as ``cfg.method`` trains on it: sequences (sft) or preference pairs (dpo, simpo,
    orpo: ``preference.py``)."""
    if cfg.method in PREFERENCE_METHODS:
        return load_preference_dataset(path, tokenizer, cfg.max_seq_len)
    return load_dataset(path, tokenizer, cfg.max_seq_len, cfg.train_on_prompt)


def new_job(model: DecoderModel, bypass: TrainableBypass, examples: list, cfg: FinetuneConfig, base_model: str = "",
            resume_from=None, validation: list | None = None) -> FinetuneJob:
    """The job for ``cfg.method``: a ``FinetuneJob`` (sft) or a ``PreferenceJob`` (dpo, simpo, orpo:
    ``examples`` and ``validation`` are preference pairs)."""
    if cfg.method in PREFERENCE_METHODS:
        return PreferenceJob(model, bypass, examples, cfg, base_model, resume_from, validation)
    return FinetuneJob(model, bypass, examples, cfg, base_model, resume_from, validation)
