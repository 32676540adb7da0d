"""MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 FP4 E2M1 elements sharing one E8M0 scale,
as gpt-oss checkpoints hold their experts (`quantization_config.quant_method == "mxfp4"`).

Checkpoint layout (per tensor `<name>`): `<name>_blocks` uint8 [..., G, 16], two elements per
byte (element 2j in the low nibble, 2j + 1 in the high one), and `<name>_scales` uint8 [..., G],
one per block of 32 along the last (input) axis. An E2M1 element is sign (bit 3), exponent
(bits 2-1, bias 1) and mantissa (bit 0): exponent 0 is subnormal (m * 0.5), else
2^(e - 1) * (1 + m / 2); the values are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. An E8M0
scale s is 2^(s - 127); 255 is NaN. Dequantized at load (tokenmill has no MXFP4 matmul yet).
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per scale
SCALE_BIAS = 127
SCALE_NAN = 255


def e2m1_values() -> torch.Tensor:
    """float32 [16]: each 4-bit code's value, decoded from its bits."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exponent, mantissa = (code >> 1) & 0b11, code & 1
        magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact in float32:
    every element times a power of two; NaN where a scale is 255)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    lut = e2m1_values().to(blocks.device)
    pairs = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(pairs.flatten(-2), exponent[..., None].float())
    values = values.masked_fill((scales == SCALE_NAN)[..., None], float("nan"))
    return values.flatten(-2).to(dtype)
