"""Quantized checkpoints load and run right: tokenmill (float32, CPU: dequantize on the fly) against
transformers in float64 running the weights that the format's spec says the checkpoint holds.

References: GPTQ, AWQ and fp8 tensors are decoded by the spec-level float64 decoders in
tests/helpers/quant_formats.py (shared with no tokenmill code); compressed-tensors int4 by the
compressed-tensors library's own decompressor, and for pack-quantized also by transformers
loading the checkpoint itself (its compressed-tensors integration, decompressed on the CPU).
FP8 W8A8 rounds activations too: the reference model rounds each quantized linear's input per
token (per token and block for block-wise) to e4m3, as the format's runtime does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.quant_formats import write_quantized_model
from tests.helpers.requirements import require_module
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM, SamplingParams

PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(48)]

CASES = {
    "fp8-channel": ("fp8-channel", {}),
    "fbgemm": ("fbgemm", {}),
    "fp8-block": ("fp8-block", {"block": (32, 32)}),
    "gptq-sym-g32": ("gptq", {"group_size": 32, "sym": True}),
    "gptq-asym-actorder": ("gptq", {"group_size": 32, "sym": False, "desc_act": True}),
    "gptq-channel": ("gptq", {"group_size": -1, "sym": True}),
    "awq-g32": ("awq", {"group_size": 32}),
    "ct-int4-sym": ("ct-int4", {"group_size": 32, "sym": True}),
    "ct-int4-asym": ("ct-int4", {"group_size": 32, "sym": False}),
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("float"))  # qwen2: q/k/v biases too


def _fake_fp8_rows(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """e4m3 rounding of x per token (per `group` columns of a token), in x's dtype."""
    shape = x.shape
    g = shape[-1] if group is None else group
    xg = x.reshape(-1, shape[-1] // g, g)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return ((xg / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale).reshape(shape).to(x.dtype)


def reference_logprobs(float_dir: str, refs: dict[str, torch.Tensor], act_group: int | None | bool) -> torch.Tensor:
    """transformers in float64 with the reference weights; `act_group` False: float activations."""
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float64)
    with torch.no_grad():
        for name, weight in refs.items():
            model.get_parameter(name).copy_(weight)
    if act_group is not False:
        for name in {n.rsplit(".", 1)[0] for n in refs}:
            model.get_submodule(name).register_forward_pre_hook(
                lambda _m, args: (_fake_fp8_rows(args[0], act_group),))
    return _hf_logprobs(model)


def _hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].double()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def engine_logprobs(path: str, **kwargs) -> torch.Tensor:
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.01, single_process=True, **kwargs)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], PROMPT[1:])], dtype=torch.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_spec_reference(case, float_dir, tmp_path):
    fmt, opts = CASES[case]
    if fmt == "ct-int4":
        require_module("compressed_tensors")
    path, refs = write_quantized_model(float_dir, tmp_path / case, fmt, **opts)
    act_group = {"fp8-channel": None, "fbgemm": None, "fp8-block": 32}.get(fmt, False)
    expected = reference_logprobs(float_dir, refs, act_group)
    got = engine_logprobs(path)
    # fp8: a float32 activation a hair from an e4m3 rounding boundary may round the other way.
    tol = 2e-3 if act_group is not False else 1e-4
    torch.testing.assert_close(got, expected, atol=tol, rtol=0)
    # Something was quantized: the float model differs.
    assert (got - _hf_logprobs(AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float64))).abs().max() > 1e-3


def test_compressed_tensors_matches_transformers_loading(float_dir, tmp_path):
    """transformers loads the pack-quantized checkpoint itself (decompressing it on the CPU, in the
    scales' dtype: float32 here, so that its weights are exact); its decompressed weights run in a
    plain float64 model (the compressed-tensors wrappers re-quantize at forward time)."""
    require_module("compressed_tensors")
    from transformers import CompressedTensorsConfig

    path, _ = write_quantized_model(float_dir, tmp_path / "ct", "ct-int4", group_size=32, sym=False,
                                    scale_dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False))
    decompressed = {name: p.detach().double() for name, p in loaded.named_parameters() if name.endswith("proj.weight")}
    assert len(decompressed) == 14
    torch.testing.assert_close(engine_logprobs(path), reference_logprobs(float_dir, decompressed, False),
                               atol=1e-4, rtol=0)
