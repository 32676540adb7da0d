"""GPTQ (Frantar et al., 2022) for test checkpoints: int4 codes chosen column by column, each
column's rounding error spread over the columns not yet quantized through the inverse Hessian of
the layer's inputs (H = 2 X^T X over calibration tokens), optionally in act-order (columns by
decreasing Hessian diagonal, which makes g_idx differ from k // G).

`gptq_checkpoint` quantizes every decoder linear of a HF float model directory this way,
calibrated on a text, and writes a GPTQ (v1) directory with tokenmill's packer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.layers.quantization import int4_packing as packing

# linear -> the module whose input it reads (q/k/v share the attention input, gate/up the MLP's)
_INPUT_OF = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
             "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}


def _group_params(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of w [..., G] (as int4_packing.quantize_int4 chooses them)."""
    if sym:
        scale = (2 * w.abs().amax(dim=-1) / 15).clamp(min=1e-8)
        return scale, torch.full_like(scale, 8)
    lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    return scale, torch.round(-lo / scale).clamp(1, 15)  # v1 stores zero - 1: keep it >= 0


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool, act_order: bool,
                  block: int = 128, damp: float = 0.01) -> list[packing.Int4Codes]:
    """GPTQ of B independent weights w [B, N, K] with their inputs' Hessians [B, K, K], solved
    together: one loop over the K columns for all of them. Each row of each weight is quantized as
    on its own. The weights are held transposed ([B, K, N]: a column one contiguous row), so each
    step's update of the columns after it is one contiguous block."""
    h = hessian.double().clone()
    b, n, k = w.shape
    diag = torch.diagonal(h, dim1=1, dim2=2)  # a view: writes reach h
    dead = diag == 0  # [B, K]
    diag[dead] = 1
    perm = (torch.argsort(diag, dim=1, descending=True) if act_order
            else torch.arange(k).expand(b, k))
    wt = w.double().masked_fill(dead[:, None, :], 0).transpose(1, 2)  # [B, K, N]
    wt = torch.gather(wt, 1, perm[:, :, None].expand(b, k, n)).contiguous()
    h = torch.gather(torch.gather(h, 1, perm[:, :, None].expand(b, k, k)), 2, perm[:, None, :].expand(b, k, k))
    h += damp * torch.diagonal(h, dim1=1, dim2=2).mean(dim=1)[:, None, None] * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    size = k if group_size == -1 else group_size
    codes = torch.zeros(b, k, n, dtype=torch.uint8)
    scales, zeros = torch.zeros(b, k // size, n, dtype=torch.float64), torch.zeros(b, k // size, n, dtype=torch.float64)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = wt[:, i1:i2].clone(), torch.zeros(b, i2 - i1, n, dtype=wt.dtype), hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col // size
            if col % size == 0:  # a new group (in quantization order): its scale from the updated weights
                current = torch.cat([w1[:, i:], wt[:, i2:]], dim=1)[:, :size]
                scales[:, g], zeros[:, g] = _group_params(current.transpose(1, 2), sym)
            s, z = scales[:, g], zeros[:, g]
            q = torch.clamp(torch.round(w1[:, i] / s) + z, 0, 15)
            codes[:, col] = q
            err = (w1[:, i] - (q - z) * s) / hinv1[:, i, i, None]
            w1[:, i:] -= hinv1[:, i, i:, None] * err[:, None, :]
            err1[:, i] = err
        wt[:, i2:] -= hinv[:, i1:i2, i2:].transpose(1, 2) @ err1
    inverse = torch.argsort(perm, dim=1)
    codes = torch.gather(codes, 1, inverse[:, :, None].expand(b, k, n)).transpose(1, 2)
    g_idx = (torch.arange(k) // size)[inverse]
    return [packing.Int4Codes(codes[i].contiguous(), scales[i].t().float().contiguous(), zeros[i].t().long().contiguous(),
                              g_idx[i]) for i in range(b)]


def input_hessians(model_dir: str, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / T of each linear input ('model.layers.i.self_attn.q_proj', ...), float model."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "o_proj", "gate_proj", "down_proj"):
            def hook(_m, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                found[name] = 2 * x.t() @ x / x.shape[0]
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    for h in hooks:
        h.remove()
    return found


def gptq_checkpoint(src: str, out: str | Path, calibration_ids: list[int], group_size: int, sym: bool,
                    act_order: bool) -> str:
    """Every decoder linear of `src` quantized by GPTQ; linears that read one input (q/k/v, gate/up)
    as one weight of stacked rows (one column loop for all of them: rows are independent)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    hessians = input_hessians(src, calibration_ids)
    state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(f))
    readers: dict[str, list[str]] = {}  # input (a key of `hessians`) -> the linears reading it
    tensors = {}
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        proj = module.rsplit(".", 1)[-1]
        if leaf == "weight" and proj in _INPUT_OF:
            readers.setdefault(module.rsplit(".", 1)[0] + "." + _INPUT_OF[proj], []).append(module)
        else:
            tensors[name] = value
    for key, modules in readers.items():
        w = torch.cat([state[m + ".weight"].float() for m in modules])
        codes = gptq_quantize(w[None], hessians[key][None], group_size, sym, act_order)[0]
        r0 = 0
        for m in modules:
            r1 = r0 + state[m + ".weight"].shape[0]
            mine = packing.Int4Codes(codes.codes[r0:r1], codes.scales[r0:r1], codes.zeros[r0:r1], codes.g_idx)
            tensors.update({f"{m}.{part}": t for part, t in packing.to_gptq(mine, zero_offset=1).items()})
            r0 = r1
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                     "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)
