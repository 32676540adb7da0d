"""Where FP8 W8A8 costs NLL on the real SmolLM2-135M: an independent float64 reference (HF
transformers, e4m3 rounding written from its definition), not tokenmill's code.

The text and model are those of tests/engine/test_quantized_smollm2.py (the GGUF's weights in
float64). Every decoder linear gets per-channel weight scales and per-token activation scales
(amax / 448, round to nearest even, saturated), as `quantization="fp8"`; the LM head and the
embedding stay float (as vLLM's online fp8). Prints the NLL change of:
  - W8A8, weights only, activations only, per-tensor weight scales;
  - the same W8A8 with the weight scales' divisor moved off 448 (how much of the change is the
    particular rounding pattern rather than the format);
  - each projection kind alone and all but it; each decoder layer alone (--layers).

    python scripts/fp8_nll_attribution.py [--layers]        # CPU; minutes (one forward per line)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """e4m3fn in float64: 3 mantissa bits, exponent >= -6, ties to even, saturated at 448."""
    exp = torch.floor(torch.log2(x.abs().clamp(min=1e-300))).clamp(min=-6)
    ulp = torch.pow(2.0, exp - 3)
    return (torch.sign(x) * torch.round(x.abs() / ulp) * ulp).clamp(-448, 448)


def fake_fp8(t: torch.Tensor, divisor: float = 448.0, per_tensor: bool = False) -> torch.Tensor:
    amax = t.abs().amax() if per_tensor else t.abs().amax(dim=-1, keepdim=True)
    scale = (amax / divisor).clamp(min=1e-12)
    return e4m3(t / scale) * scale


def float_checkpoint(root: str) -> tuple[str, list[int]]:
    from safetensors.torch import save_file

    from tests.engine.test_quantized_smollm2 import TEXT
    from tests.helpers.requirements import SMOLLM2_GGUF, require_smollm2
    from tokenmill.model.arch import model_arch
    from tokenmill.model.gguf_loader import GGUFWeights
    from tokenmill.model.hf_config import load_hf_config
    from tokenmill.model.tokenizer import load_tokenizer
    gguf = require_smollm2() + "/" + SMOLLM2_GGUF
    config = load_hf_config(gguf)
    tensors = {name: t.float().contiguous() for name, t in GGUFWeights(gguf, model_arch(config))}
    save_file(tensors, os.path.join(root, "model.safetensors"))
    config.save_pretrained(root)
    tokenizer = load_tokenizer(gguf)
    return root, tokenizer(TEXT).input_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", action="store_true", help="also each decoder layer alone (30 more forwards)")
    ns = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path, ids = float_checkpoint(tempfile.mkdtemp(prefix="smollm2-f64-"))
    ids = torch.tensor(ids)[None]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.")}
    original = {n: m.weight.data.clone() for n, m in linears.items()}
    quantized_acts: set[str] = set()
    for name, module in linears.items():
        module.register_forward_pre_hook(
            lambda mod, args, name=name: (fake_fp8(args[0]),) if name in quantized_acts else None)

    def nll(weights: set[str], acts: set[str], **weight_opts) -> float:
        quantized_acts.clear()
        quantized_acts.update(acts)
        for name, module in linears.items():
            module.weight.data = fake_fp8(original[name], **weight_opts) if name in weights else original[name]
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()

    every = set(linears)
    base = nll(set(), set())
    print(f"float64 NLL {base:.5f} over {ids.shape[1]} tokens; {len(every)} linears quantized (LM head and embedding stay float)")

    def show(label: str, weights: set[str], acts: set[str], **opts) -> float:
        change = (nll(weights, acts, **opts) / base - 1) * 100
        print(f"  {label:48s} {change:+.2f}%", flush=True)
        return change

    show("W8A8 (per-channel weights, per-token acts)", every, every)
    show("weights only", every, set())
    show("activations only", set(), every)
    show("W8A8, per-tensor weight scales", every, every, per_tensor=True)
    for divisor in (447.0, 446.0, 440.0, 430.0):
        show(f"W8A8, weight scales amax / {divisor:g}", every, every, divisor=divisor)
    for kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        part = {n for n in every if n.endswith(kind)}
        show(f"{kind} alone", part, part)
        show(f"all but {kind}", every - part, every - part)
    if ns.layers:
        for i in range(model.config.num_hidden_layers):
            part = {n for n in every if n.startswith(f"model.layers.{i}.")}
            show(f"layer {i} alone", part, part)
        last = {n for n in every if n.startswith(f"model.layers.{model.config.num_hidden_layers - 1}.")}
        show("all but the last layer", every - last, every - last)


if __name__ == "__main__":
    main()
