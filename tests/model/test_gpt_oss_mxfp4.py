"""gpt-oss's MXFP4 experts (OCP Microscaling: FP4 E2M1 pairs per byte, an E8M0 scale per 32):
tokenmill's decoder against an independent float64 one written from the spec (every byte value,
scales across the range, NaN), and a tiny random gpt-oss quantized by our own spec quantizer
(`tests/helpers/mxfp4.py`), loaded by tokenmill (dequantized at load) against HF transformers
loading the same MXFP4 checkpoint (its CPU path dequantizes it: the reference here), float32:
the loaded experts equal the float64 decoding, greedy tokens equal HF's, logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.moe_reference import check_against_hf, generate, prompts_for
from tests.helpers.mxfp4 import decode_float64, mxfp4_checkpoint, quantize
from tests.helpers.tiny_moe_models import make_tiny_moe_model_dir
from tokenmill import LLM
from tokenmill.model import mxfp4


def test_decoder_matches_the_spec_on_every_byte_and_scale():
    codes = torch.arange(256, dtype=torch.uint8)
    blocks = codes.reshape(16, 1, 16).repeat(1, 4, 1)  # 16 rows x 4 blocks: every byte in every row
    # 252: the largest scale whose elements all fit float32 (6 * 2^125); 0: subnormal float32 results.
    scales = torch.tensor([0, 1, 100, 127, 128, 140, 252, 255] * 8, dtype=torch.uint8).reshape(16, 4)
    got = mxfp4.dequantize(blocks, scales, torch.float32)
    want = decode_float64(blocks, scales)
    assert got.dtype == torch.float32 and got.shape == want.shape == (16, 128)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.isnan(), (scales == 255).repeat_interleave(32, dim=-1))  # scale 255 is NaN, nothing else
    # Planted: the nibbles in the other order must not pass.
    swapped = (blocks >> 4) | (blocks << 4)
    assert not torch.allclose(mxfp4.dequantize(swapped, scales).double(), want, equal_nan=True)


def test_quantizer_round_trip():
    """The spec quantizer's output decodes to within 2X of the input (X the block's scale: E2M1's
    widest step, 4 -> 6, is 2X, and the largest element may saturate from below 8X to 6X)."""
    w = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 0.1])[:, None]
    w[1, :32] = 0.0  # an all-zero block
    blocks, scales = quantize(w)
    back = decode_float64(blocks, scales)
    step = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)  # X: the grid's unit
    assert ((back - w.double()).abs() <= 2 * step).all()
    assert ((back - w.double()).abs() <= step).float().mean() > 0.9  # most are within X
    assert (back[1, :32] == 0).all()
    torch.testing.assert_close(mxfp4.dequantize(blocks, scales).double(), back, rtol=0, atol=0)


def test_mismatched_halves_are_refused():
    with pytest.raises(ValueError, match="blocks .* do not match scales"):
        mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return mxfp4_checkpoint(make_tiny_moe_model_dir("gpt_oss", root), root / "mxfp4")


def test_mxfp4_checkpoint_matches_hf_dequantizing_it(mxfp4_dir):
    from safetensors.torch import load_file
    hf = AutoModelForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32).eval()
    # HF dequantized the experts (no `kernels` here): dense float32 parameters, not our float copy's.
    assert hf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    ckpt = load_file(f"{mxfp4_dir}/model.safetensors")
    prompts = prompts_for("gpt_oss")
    with LLM(mxfp4_dir, dtype="float32", single_process=True, max_num_batched_tokens=16, kv_cache_memory_gb=0.01,
             max_model_len=128, async_scheduling=False) as llm:
        model = llm.engine.executor.worker.runner.model
        experts = model.model.layers[1].mlp.experts
        gate_up = decode_float64(ckpt["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                 ckpt["model.layers.1.mlp.experts.gate_up_proj_scales"])  # [E, 2I, H] interleaved
        down = decode_float64(ckpt["model.layers.1.mlp.experts.down_proj_blocks"],
                              ckpt["model.layers.1.mlp.experts.down_proj_scales"])  # [E, H, I]
        torch.testing.assert_close(experts.w13.double(), torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1),
                                   rtol=0, atol=0)
        torch.testing.assert_close(experts.w2.double(), down, rtol=0, atol=0)
        # HF read the same values (its [E, in, out] layout): the reference runs the checkpoint, not a random init.
        hf_experts = hf.model.layers[1].mlp.experts
        torch.testing.assert_close(hf_experts.gate_up_proj.detach().double(), gate_up.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(hf_experts.down_proj.detach().double(), down.transpose(1, 2), rtol=0, atol=0)
        check_against_hf(hf, prompts, generate(llm, prompts), "gpt-oss MXFP4")
