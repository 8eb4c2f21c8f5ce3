"""Load a Hugging Face model directory into a DecoderModel."""

from __future__ import annotations

from pathlib import Path

import torch

from coserve.model.config import ModelConfig
from coserve.model.decoder import DecoderModel
from coserve.model.mxfp4 import dequantize_state
from coserve.model.weights import check_state_dict, load_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """``"auto"`` picks the checkpoint's dtype; otherwise one of float32, bfloat16, float16."""
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """``None`` or ``"auto"`` picks cuda when available, else cpu."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device: {name!r} is not a torch device ({e})") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    return device


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None, pack_gemms: bool = True) -> DecoderModel:
    """Read config and weights from ``model_dir``; errors name the file and tensor at fault. ``pack_gemms``: MKL
    packs of the frozen weights where they apply (CPU, float32: ``coserve/model/packed_gemm.py``). gpt-oss's MXFP4
    experts are dequantized to ``dtype`` (``coserve/model/mxfp4.py``)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    state = load_state_dict(model_dir)
    dequantize_state(state, dtype)
    check_state_dict(state, cfg, model_dir)
    return DecoderModel(cfg, state, device, dtype, max_positions or cfg.max_position_embeddings, pack_gemms)
