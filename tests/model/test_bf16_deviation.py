"""tokenmill's bf16 stays at least as close to float32 as HF transformers' bf16 (teacher-forced).

Each model runs the same token sequences in tokenmill float32 / bf16 and HF float32 / bf16 on the
same weights (`tokenmill.benchmarks.bf16_deviation`); the log-probability of every true next token
is compared with its own float32 run. tokenmill's mean, p99 and max |deviation| are each held to
HF's, for one prefill step and for token-by-token decoding.

The real SmolLM2 (80 tokens of English): no tolerance. Measured (AMD EPYC Zen 4, avx512_bf16
path): tokenmill / HF = 0.60 / 0.75 / 0.75 (prefill) and 0.58 / 0.58 / 0.54 (decode) of HF's
0.0299 / 0.106 / 0.125 nats; the other paths (TOKENMILL_CPU_PATH=avx512/avx2/generic) 0.60 /
0.75 / 0.75 and 0.58 / 0.51 / 0.49. A planted bf16 RMSNorm (statistics and all in bf16) fails it:
prefill 0.95 / 1.32 / 1.44 x HF's (docs/bf16-numerics.md).

Tiny random configs: TINY_TOLERANCE on the mean, TINY_TAIL_TOLERANCE on p99 / max. Justified by
measurement: at hidden size 64 most of the bf16 error is common to both engines (the same bf16
weights, the same rounded matmul inputs), so the ratios scatter around 1 with the few roundings
tokenmill skips; over the 8 families below, unplanted, they spread 0.81-1.05 (mean) and
0.61-1.16 (p99 / max, single order statistics of 78 tokens; worst qwen3 prefill).
The planted bf16 norm moves tiny llama's decode to 1.25 / 1.21 / 1.34 and qwen3's to 1.11 /
1.64 / 1.78: failed here as well. Not covered: the MoE families (a bf16 router can flip an
expert choice, a jump HF's bf16 may or may not make on the same token: the tiny qwen3_moe of
tests/helpers/tiny_moe_models.py deviates up to ~1 nat, open in docs/bf16-numerics.md) and
DeepSeek (MLA: the harness drives a standard paged KV cache, not MLA's latent one).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.requirements import require_smollm2
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill.benchmarks import bf16_deviation as bd

TINY_TOLERANCE = 0.10
TINY_TAIL_TOLERANCE = 0.30  # p99 and max of 78 tokens are single order statistics on the tiny configs
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def _random_sequences(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bf16-tiny")
    # Weights of std 0.1 (HF's default 0.02 leaves logits near 0, where bf16 hardly shows).
    return {arch: make_tiny_model_dir(arch, root, seed=3, initializer_range=0.1) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_family_not_worse_than_hf(tiny_dirs: dict[str, str], arch: str) -> None:
    sequences = _random_sequences(200, 2, 40)
    report = bd.measure_path(tiny_dirs[arch], sequences, label=arch)
    print("\n" + bd.format_table([report]))
    assert report.float32_gap < 1e-4  # the float32 references agree
    bd.check_not_worse(report, TINY_TOLERANCE, TINY_TAIL_TOLERANCE)


@pytest.fixture(scope="module")
def smollm2_models():
    from tokenmill.model.default_model import DEFAULT_MODEL, resolve_model_path
    require_smollm2()
    path = resolve_model_path(DEFAULT_MODEL)
    dtypes = (torch.float32, torch.bfloat16)
    return path, {d: bd.load_tokenmill(path, d) for d in dtypes}, bd.load_hf_pair(path)


@pytest.mark.slow
def test_smollm2_real_text_not_worse_than_hf(smollm2_models) -> None:
    path, tm, hf = smollm2_models
    sequences = bd.text_sequences(path, bd.SAMPLE_TEXT, 80)
    report = bd.measure("SmolLM2-135M-Instruct", sequences, tm, hf)
    print("\n" + bd.format_table([report]))
    assert report.float32_gap < 1e-3
    bd.check_not_worse(report, 0.0)  # mean, p99 and max, each at most HF's


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_smollm2_readme_demo_answers_paris(smollm2_models, dtype: torch.dtype) -> None:
    """The README's demo question, greedy, at the model level: the answer names Paris."""
    from tokenmill.model.tokenizer import load_tokenizer
    path, tm, _ = smollm2_models
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    answer = tokenizer.decode(bd.greedy(tm[dtype], prompt, 10))
    assert "Paris" in answer, answer
