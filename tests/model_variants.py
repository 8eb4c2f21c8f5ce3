"""Tiny models of a particular shape, made by the ``config_variant`` fixture (conftest.py)."""

from __future__ import annotations

import json


def phi3_longrope(config_variant, original: int = 32):
    """A tiny Phi-3 as Phi-3.5/Phi-4-mini rotate: the first half of each head (``partial_rotary_factor``; the tiny
    preset's heads are 16 wide, so 8 dimensions in 4 frequencies) by LongRoPE (original context ``original`` of 512),
    cos and sin scaled by its attention factor."""
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [4.0, 6.0, 9.0, 12.0],
              "original_max_position_embeddings": original}
    return config_variant("phi3", partial_rotary_factor=0.5, max_position_embeddings=512,
                          original_max_position_embeddings=original, rope_parameters=params)


def yarn_variant(model_factory, config_variant, arch: str, original: int = 32):
    """A tiny ``arch`` model rotated by YaRN (Qwen2.5 and Qwen3's long-context setting): factor 4 over an original
    context of ``original`` positions, its own theta kept."""
    theta = json.loads((model_factory(arch) / "config.json").read_text())["rope_parameters"]["rope_theta"]
    return config_variant(arch, rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": 4.0,
                                                 "original_max_position_embeddings": original})
