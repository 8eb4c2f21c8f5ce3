"""gpt-oss's MXFP4 experts, dequantized as a checkpoint is read (as transformers does with ``Mxfp4Config(dequantize=
True)``, the path it takes without its Triton kernels).

The released gpt-oss checkpoints hold each layer's experts' matrices as ``<name>_blocks`` ``[E, R, G, 16]`` (two
4-bit E2M1 values a byte, the low nibble first, 32 a block) and ``<name>_scales`` ``[E, R, G]`` (each block's
power-of-two exponent, biased by 127), for a matrix ``<name>`` ``[E, G * 32, R]`` (transposed: the checkpoint's rows
are the matrix's columns). Every value of an E2M1 code times a power of two is exact in float32 and bfloat16.
"""

from __future__ import annotations

import torch

# The 16 E2M1 codes' values, by code (the high bit the sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix ``[E, G * 32, R]`` of ``blocks`` ``[E, R, G, 16]`` (uint8) and ``scales`` ``[E, R, G]`` (uint8)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [..., G, 16] for scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Each ``<name>_blocks``/``<name>_scales`` pair of ``state`` replaced, in place, by ``<name>`` in ``dtype``."""
    for key in [k for k in state if k.endswith("_blocks")]:
        name = key[:-len("_blocks")]
        if name + "_scales" in state:
            state[name] = dequantize_mxfp4(state.pop(key), state.pop(name + "_scales"), dtype)
