"""MXFP4 written and read from the OCP Microscaling Formats (MX) v1.0 spec, independently of
`tokenmill.model.mxfp4`: a quantizer (tests build MXFP4 checkpoints with it) and a float64 decoder
that reads each element's bits one by one.

Spec, for FP4 E2M1 blocks of 32 (section 6.3): shared_exp = floor(log2(max |v|)) - emax_elem
(emax_elem = 2 for E2M1), clamped to E8M0's range; X = 2^shared_exp; each element is v / X rounded
to the nearest E2M1 value (ties to even mantissa), saturating at +-6. gpt-oss packs element 2j in
a byte's low nibble and 2j + 1 in its high one; the E8M0 scale byte is shared_exp + 127.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
EMAX_ELEM = 2


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32])."""
    v = w.double().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = v.abs().amax(dim=-1)
    shared = torch.floor(torch.log2(amax.clamp(min=2.0 ** -127))) - EMAX_ELEM
    shared = shared.clamp(-127, 127)
    scaled = (v / torch.pow(2.0, shared)[..., None]).clamp(-6.0, 6.0)
    diff = (scaled.abs()[..., None] - _MAGNITUDES).abs()
    best = diff == diff.min(dim=-1, keepdim=True).values
    even = best & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.double().argmax(-1), best.double().argmax(-1))
    codes = (index | ((scaled < 0) & (index > 0)).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (shared + 127).to(torch.uint8)


def decode_float64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The spec's decoding, element by element, in float64: [..., G, 16] + [..., G] -> [..., G * 32]."""
    flat_blocks = blocks.reshape(-1, 16).tolist()
    flat_scales = scales.reshape(-1).tolist()
    out = []
    for row, s in zip(flat_blocks, flat_scales):
        scale = float("nan") if s == 255 else 2.0 ** (s - 127)
        for byte in row:
            for code in (byte & 0xF, byte >> 4):
                sign = -1.0 if code >> 3 else 1.0
                e, m = (code >> 1) & 3, code & 1
                value = m * 2.0 ** -1 if e == 0 else 2.0 ** (e - 1) * (1.0 + m * 2.0 ** -1)
                out.append(sign * value * scale)
    return torch.tensor(out, dtype=torch.float64).reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def mxfp4_checkpoint(src: str, dst: str | Path) -> str:
    """A copy of the gpt-oss HF folder `src` with its experts' weights in MXFP4, as OpenAI ships
    them: `gate_up_proj_blocks` [E, 2I, H / 32, 16] (output rows, gate and up interleaved),
    `down_proj_blocks` [E, H, I / 32, 16], with their `_scales`; biases stay float."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # HF holds [E, in, out]: quantize each output row along its input axis.
                tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(t.transpose(1, 2).contiguous())
            else:
                tensors[name] = t.contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


def dequantized_twin(mxfp4_dir: str, dst: str | Path) -> str:
    """The float32 HF folder holding exactly the values the MXFP4 folder decodes to (float64 spec
    decoder), without a quantization_config: a reference any transformers loads, on any device."""
    src, dst = Path(mxfp4_dir), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    loaded = load_file(src / "model.safetensors")
    tensors = {}
    for name, t in loaded.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            tensors[base] = decode_float64(t, loaded[base + "_scales"]).float().transpose(1, 2).contiguous()
        elif not name.endswith("_scales"):
            tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)
