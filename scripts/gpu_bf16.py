"""bf16 numerics on a CUDA GPU: tokenmill's bf16 deviation from float32 against HF transformers' bf16.

    python scripts/gpu_bf16.py            # H100: SmolLM2-135M and Llama-3.2-1B shapes (~3-5 min)
    python scripts/gpu_bf16.py --smoke    # any machine (CPU): tiny shapes, a few tokens
    python scripts/gpu_bf16.py --shapes none --families --smollm2 PATH.gguf
                                          # the CPU test's table on the GPU: every family's tiny
                                          # config and the real SmolLM2 (its GGUF)
    python scripts/gpu_bf16.py --shapes none --families qwen3,gemma3,qwen3_moe --moe-seeds 3,4,5 \
        --layer-trace --qk-kernel           # q/k-norm families: the Triton q/k norm + rotary kernel
                                          # checked in bf16, and where each MoE row's error enters
    python scripts/gpu_bf16.py --shapes none --families qwen3,gemma3,qwen3_moe --moe-seeds 3,4,5 \
        --qk-kernel --forced-routing [--tail] [--backends triton]
                                          # MoE rows judged with every bf16 run routed as its float32
                                          # run (a flipped near tie's echo left out; the routed
                                          # table printed, `judged: false`); --tail: the positions
                                          # behind each routed row's p99 / max and the flips before
    python scripts/gpu_bf16.py --shapes none --families phi3,qwen3_moe --spread
                                          # some families, and HF's own spread: its bf16 deviation
                                          # with eager and with SDPA attention (two valid references)

For each shape, random weights (std 0.06, norms 1) go into HF float32, HF bf16, tokenmill float32
and tokenmill bf16 models (the same values, rounded alike). HF float32 continues 16 random 8-token
prompts greedily to 64 tokens; then every model is teacher-forced over those 16 x 64 tokens and
the log-probability of each true next token is compared with its own float32 run (mean / p99 / max
|deviation|, nats). tokenmill runs twice: with the Triton kernels (paged attention + fused norm /
rotary / SiLU) and with the torch reference (TorchRef attention, fused ops off), each in one prefill
step and token by token (decode).

TF32 is off for every float32 matmul and convolution (HF's and tokenmill's float32 runs are the
references). HF's attention is transformers' default except where `bf16_deviation.hf_attention`
asks for eager (Gemma 2's soft-capped attention: transformers 5.17 picks SDPA there and drops the
soft-cap).

Checks (exit 1 on failure): tokenmill float32 within 2e-3 of HF float32 (max |logprob difference|),
and tokenmill bf16's mean, p99 and max deviation each at most 10% above HF bf16's, per backend and
mode. Prints a table; writes $OUT/gpu_bf16.json after every row ($OUT defaults to ./gpu-out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.benchmarks import bf16_deviation as bd  # noqa: E402
from tokenmill.benchmarks import bf16_diagnostics as diag  # noqa: E402
from tokenmill.benchmarks.record import machine_info, versions  # noqa: E402
from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend  # noqa: E402

TOLERANCE = 0.10
FLOAT32_GAP = 2e-3
WEIGHT_STD = 0.06
START = time.perf_counter()

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         rope_theta=500000.0),
}
SMOKE_SHAPES = {
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
                       tie_word_embeddings=True),
}


def hf_random_model(shape: dict, device: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, WEIGHT_STD)
    return model.eval()


@torch.inference_mode()
def continuations(hf32, num: int, prompt_len: int, total: int, device: str, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, hf32.config.vocab_size, (num, prompt_len), generator=gen).to(device)
    out = hf32.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=total - prompt_len,
                        min_new_tokens=total - prompt_len, do_sample=False, pad_token_id=0)
    return out[:, :total].tolist()


@contextlib.contextmanager
def fused_ops(enabled: bool):
    """Turns the fused Triton elementwise kernels on or off (they read an env var once, cached)."""
    previous = os.environ.get(triton_ops.DISABLE_ENV_VAR)
    os.environ[triton_ops.DISABLE_ENV_VAR] = "0" if enabled else "1"
    triton_ops._usable.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(triton_ops.DISABLE_ENV_VAR, None)
        else:
            os.environ[triton_ops.DISABLE_ENV_VAR] = previous
        triton_ops._usable.cache_clear()


BACKENDS: set[str] | None = None  # --backends: the subset to run (None: every one the device has)


def backends(device: str) -> dict[str, tuple[type, bool]]:
    """name -> (attention backend class, fused ops on)."""
    out = {"torch": (TorchRefAttentionBackend, False)}
    if device.startswith("cuda"):
        from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
        out["triton"] = (TritonAttentionBackend, True)
    return {k: v for k, v in out.items() if BACKENDS is None or k in BACKENDS}


def judge(report, float32_gap: float, tolerance: float, tail_tolerance: float) -> dict:
    """Prints the report and its verdict; the record's report fields, worst ratio, ok and failure."""
    ok_gap = report.float32_gap <= float32_gap
    try:
        bd.check_not_worse(report, tolerance, tail_tolerance)
        ok_bf16, why = True, ""
    except AssertionError as exc:
        ok_bf16, why = False, str(exc).splitlines()[0]
    print(bd.format_table([report]), flush=True)
    print(f"  float32 gap {'ok' if ok_gap else 'FAIL'}; bf16 vs HF {'ok' if ok_bf16 else 'FAIL: ' + why}; "
          f"worst ratio {report.worst_ratio():.3f}", flush=True)
    return {**report.as_dict(), "worst_ratio": report.worst_ratio(), "ok": ok_gap and ok_bf16,
            "failure": why or (None if ok_gap else "float32 gap")}


def run_shape(name: str, shape: dict, device: str, num: int, prompt_len: int, total: int) -> list[dict]:
    start = time.perf_counter()
    hf32 = hf_random_model(shape, device)
    seqs = continuations(hf32, num, prompt_len, total, device)
    hf16 = hf_random_model(shape, device).to(torch.bfloat16)  # same seed: same weights, rounded
    hf = {torch.float32: hf32, torch.bfloat16: hf16}
    records = []
    for backend, (cls, fused) in backends(device).items():
        with fused_ops(fused):
            tm = {d: bd.tokenmill_from_hf(hf32, d, device, cls) for d in (torch.float32, torch.bfloat16)}
            report = bd.measure(f"{name} [{backend}]", seqs, tm, hf)
        del tm
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        records.append({"shape": name, "backend": backend, "fused_ops": fused, "sequences": num, "tokens": total,
                        "weight_std": WEIGHT_STD, **judge(report, FLOAT32_GAP, TOLERANCE, TOLERANCE)})
    print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    del hf32, hf16
    return records


def run_checkpoint(label: str, path: str, sequences: list[list[int]], device: str, tolerance: float,
                   tail_tolerance: float, float32_gap: float, **measure_kwargs) -> list[dict]:
    """The CPU test's check (tests/model/test_bf16_deviation.py) for one checkpoint, per backend."""
    records = []
    for backend, (cls, fused) in backends(device).items():
        try:
            with fused_ops(fused):
                report = bd.measure_path(path, sequences, label=f"{label} [{backend}]", device=device,
                                         attn_backend_cls=cls, **measure_kwargs)
        except Exception as exc:  # one family's failure is a record, not the end of the table
            print(f"{label} [{backend}]: FAILED to run: {exc!r}", flush=True)
            records.append({"shape": label, "backend": backend, "ok": False, "failure": repr(exc)[:500]})
            continue
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        records.append({"shape": label, "backend": backend, "fused_ops": fused, "sequences": len(sequences),
                        "tokens": len(sequences[0]), "tolerance": [tolerance, tail_tolerance],
                        **judge(report, float32_gap, tolerance, tail_tolerance)})
    return records


def hf_spread(label: str, path: str, sequences: list[list[int]], device: str,
              tie_margin: float | None = None) -> dict:
    """HF's bf16 deviation from its own float32 with eager and with SDPA attention (both valid
    references): how much HF's statistics move between two implementations of the same
    numerics, the scale a tolerance on tokenmill / HF must allow. With `tie_margin` (MoE), the
    check's exclusions: float32 routing near ties and positions either HF run's bf16 routed
    otherwise than its float32."""
    f32, bf16 = torch.float32, torch.bfloat16
    stats, dev, keep = {}, {}, []
    tm32 = bd.load_tokenmill(path, f32, device) if tie_margin is not None else None
    moe = tm32.dims.moe if tm32 is not None else None
    if tm32 is not None:
        keep = [(bd.router_margins(tm32, s) >= tie_margin)[:-1] for s in sequences]
    for attn in ("eager", "sdpa"):
        try:
            hf = bd.load_hf_pair(path, device, attn)
        except Exception as exc:  # noqa: BLE001 - e.g. SDPA refused for a soft-capped family
            stats[attn] = repr(exc)[:200]
            continue
        dev[attn] = []
        for i, s in enumerate(sequences):
            (h32, r32), (h16, r16) = (bd.hf_routes(hf[d], s, moe) for d in (f32, bf16))
            dev[attn].append(bd.target_logprobs(h16, s) - bd.target_logprobs(h32, s))
            if keep:
                keep[i] &= ~bd.routing_flips(r16, r32)[:-1]
        del hf
    for attn, d in dev.items():
        stats[attn] = bd.Stats.of(torch.cat([x[k.to(x.device)] for x, k in zip(d, keep)]) if keep else torch.cat(d))
    record = {"shape": label, "spread": {k: v if isinstance(v, str) else vars(v) for k, v in stats.items()}}
    if all(isinstance(v, bd.Stats) for v in stats.values()):
        e, q = stats["eager"], stats["sdpa"]
        record["ratios_sdpa_over_eager"] = {f: getattr(q, f) / max(getattr(e, f), 1e-12) for f in ("mean", "p99", "max")}
    print(f"{label}: HF bf16 spread (eager vs SDPA): {record['spread']} "
          f"ratios {record.get('ratios_sdpa_over_eager')}", flush=True)
    return record


def run_families(device: str, smoke: bool, only: set[str] | None = None, spread: bool = False,
                 moe_seeds: list[int] | None = None, router_noise: bool = False,
                 layer_trace: bool = False, forced: bool = False, tail: bool = False,
                 moe_sequences: int = 4, on_row=lambda records: None) -> list[dict]:
    """Every family of the CPU test (or those in `only`), its tiny config (same seed, std, sequences
    and tolerances), the dense families and then the mixtures of experts and MLA. `moe_seeds`: the
    MoE families' weights drawn with each of these seeds (default the CPU test's), one record each;
    `router_noise`: each MoE row also prints how far every router's float32 logits (from its bf16
    input) land from the float32 run's, per engine and mode (`diag.router_logit_errors`);
    `forced`: each MoE row is also measured with every bf16 run routed as its float32 run
    (`diag.forced_routing`), and that table is the row's verdict (the routed one is still printed
    and recorded, `judged: false`); `tail`: the positions behind each MoE row's p99 / max, with the
    routing flips before them (`diag.tail_positions`); `moe_sequences`: sequences per MoE row."""
    import tempfile

    from tests.helpers.tiny_models import make_tiny_model_dir
    from tests.model import test_bf16_deviation as cpu_test
    def pick(archs):  # smoke: the first of those asked for
        chosen = [a for a in archs if only is None or a in only]
        return chosen[:1] if smoke else chosen
    root = tempfile.mkdtemp(prefix="bf16-tiny-")
    records, spreads = [], []
    gap = 1e-4 if device == "cpu" else FLOAT32_GAP
    for arch in pick(cpu_test.FAMILIES):
        path = make_tiny_model_dir(arch, root, seed=3, initializer_range=0.1)
        seqs = cpu_test._random_sequences(200, 2, 40)
        records += run_checkpoint(arch, path, seqs, device, cpu_test.TINY_TOLERANCE, cpu_test.TINY_TAIL_TOLERANCE, gap)
        if spread:
            spreads.append(hf_spread(arch, path, seqs, device))
        on_row(records)
    # Mixtures of experts and MLA: routing near ties and flips left out, counted and capped, as on CPU.
    for arch in pick(cpu_test.MOE_FAMILIES):
        for seed in moe_seeds or [cpu_test.MOE_SEED]:
            label = arch if seed == cpu_test.MOE_SEED else f"{arch} seed {seed}"
            path = cpu_test.make_tiny_moe_model_dir(arch, os.path.join(root, f"s{seed}"), seed=seed,
                                                    initializer_range=0.1)
            seqs = cpu_test._random_sequences(200, 2 if smoke else moe_sequences, 40)
            routed = run_checkpoint(label, path, seqs, device, cpu_test.MOE_TOLERANCE,
                                    cpu_test.MOE_TAIL_TOLERANCE, gap, tie_margin=cpu_test.MOE_TIE_MARGIN,
                                    max_excluded=cpu_test.MOE_MAX_EXCLUDED)
            if tail:
                for r in routed:
                    if "worst_ratio" in r:
                        r["tail"] = run_tail(r["shape"], path, seqs, device, r["backend"])
            if forced:
                for r in routed:
                    r["judged"] = False
                records += routed + run_forced(label, path, seqs, device, gap)
            else:
                records += routed
            if router_noise:
                records[-1]["router_noise"] = run_router_noise(label, path, seqs, device)
            if layer_trace:
                records[-1]["layer_errors"] = run_layer_trace(label, path, seqs, device)
            if spread:
                spreads.append(hf_spread(label, path, seqs, device, cpu_test.MOE_TIE_MARGIN))
            on_row(records)
            print(f"{label}: done at {time.perf_counter() - START:.1f} s", flush=True)
    return records, spreads


def run_forced(label: str, path: str, sequences: list[list[int]], device: str, gap: float) -> list[dict]:
    """The MoE row's deviation table with every bf16 run routed as its own float32 run routed,
    judged with the MoE tolerances (every position scored: no near tie or flip left out)."""
    from tests.model import test_bf16_deviation as cpu_test
    records = []
    for backend, (cls, fused) in backends(device).items():
        with fused_ops(fused):
            report = diag.forced_routing(path, sequences, f"{label} forced [{backend}]", device, cls)
        records.append({"shape": f"{label} forced routing", "backend": backend, "fused_ops": fused,
                        "sequences": len(sequences), "tokens": len(sequences[0]),
                        "tolerance": [cpu_test.MOE_TOLERANCE, cpu_test.MOE_TAIL_TOLERANCE],
                        **judge(report, gap, cpu_test.MOE_TOLERANCE, cpu_test.MOE_TAIL_TOLERANCE)})
    return records


def run_tail(label: str, path: str, sequences: list[list[int]], device: str, backend: str) -> dict:
    """Each engine's largest kept deviations (tokenmill prefill) with the flips before them."""
    from tests.model import test_bf16_deviation as cpu_test
    cls, fused = backends(device)[backend]
    with fused_ops(fused):
        tails = diag.tail_positions(path, sequences, device, cls, tie_margin=cpu_test.MOE_TIE_MARGIN)
    print(diag.format_tail(label, tails), flush=True)
    return tails


def run_router_noise(label: str, path: str, sequences: list[list[int]], device: str) -> dict:
    """Per MoE layer, |router logits of the bf16 run - of the float32 run| (both computed in float32
    from each run's router input): p50 / p90 / p99 for HF and for tokenmill per backend and mode."""
    out = {}
    for backend, (cls, fused) in backends(device).items():
        with fused_ops(fused):
            errors = diag.router_logit_errors(path, sequences, device, cls)
        out[backend] = errors
        for run, layers in errors.items():
            print(f"{label} [{backend}] router logit error {run:<18} " + "  ".join(
                f"L{i}: p50 {q['p50']:.4f} p90 {q['p90']:.4f} p99 {q['p99']:.4f}" for i, q in enumerate(layers)),
                flush=True)
    return out


def run_layer_trace(label: str, path: str, sequences: list[list[int]], device: str) -> dict:
    """Per decoder layer: mean |stream_bf16 - stream_f32| / |stream_f32| per engine, backend and mode."""
    out = {}
    for backend, (cls, fused) in backends(device).items():
        with fused_ops(fused):
            errors = diag.layer_errors(path, sequences, device, cls)
        out[backend] = errors
        for run, layers in errors.items():
            print(f"{label} [{backend}] stream error {run:<18} " + "  ".join(
                f"L{i} {e:.4f}" for i, e in enumerate(layers)), flush=True)
    return out


def check_qk_kernel(device: str) -> dict:
    """`triton_ops.qk_norm_rope` against its torch reference on the device, float32 / fp16 / bf16
    outputs: float32 within 2e-6, half types within one unit in the last place."""
    from tokenmill.config import RopeConfig
    from tokenmill.layers import qk_norm
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.layers.triton_ops.qk_norm_rope import qk_norm_rope
    worst: dict[str, float] = {}
    ok = True
    for head_dim, partial, hq, hk in ((128, 1.0, 32, 4), (64, 0.5, 9, 3)):
        rope = RotaryEmbedding(head_dim, 4096, RopeConfig(theta=1e6, partial_rotary_factor=partial)).to(device)
        gen = torch.Generator().manual_seed(head_dim + hq)
        t = 37
        qkv = (3 * torch.randn(t, (hq + 2 * hk) * head_dim, generator=gen)).to(device)
        positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
        q = qkv[:, :hq * head_dim].view(t, hq, head_dim)
        k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(t, hk, head_dim)
        wq, wk = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device), torch.ones(head_dim, device=device)
        cos = rope.cos_cache.index_select(0, positions)[:, None, :rope.rotary_dim]
        sin = rope.sin_cache.index_select(0, positions)[:, None, :rope.rotary_dim]
        for dtype in (torch.float32, torch.bfloat16):
            got = qk_norm_rope(q, k, wq, wk, 1e-6, 1e-6, positions, rope.cos_cache, rope.sin_cache, rope.rotary_dim, dtype)
            ref = (qk_norm.norm_rope_reference(q, wq, 1e-6, cos, sin, dtype),
                   qk_norm.norm_rope_reference(k, wk, 1e-6, cos, sin, dtype))
            bits = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
            for a, b in zip(got, ref):
                diff = (a.double() - b.double()).abs()
                ulp = torch.exp2(torch.floor(torch.log2(b.double().abs().clamp_min(1e-30))) - bits)
                if dtype == torch.float32:
                    err = float((diff / (2e-6 * b.double().abs().max())).max())
                else:
                    err = float((diff / ulp).max())
                key = f"d{head_dim} p{partial} {str(dtype).removeprefix('torch.')}"
                worst[key] = max(worst.get(key, 0.0), err)
                ok &= err <= 1.0
    print(f"qk_norm_rope kernel vs torch reference (ulps; float32: units of 2e-6 x max): {worst} "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return {"shape": "qk_norm_rope kernel", "backend": "triton", "worst": worst, "ok": ok,
            "failure": None if ok else "qk_norm_rope beyond one rounding of its reference"}


def run_smollm2(path: str, device: str) -> list[dict]:
    """The real SmolLM2 (its GGUF) on 80 tokens of English, no tolerance (the CPU test's check)."""
    sequences = bd.text_sequences(path, bd.SAMPLE_TEXT, 80)
    return run_checkpoint("SmolLM2-135M-Instruct", path, sequences, device, 0.0, 0.0, 1e-3 if device == "cpu" else FLOAT32_GAP)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens (runs on CPU)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the shapes ('none': skip them)")
    p.add_argument("--families", nargs="?", const="all", default=None,
                   help="also every family's tiny config (the CPU test's), or a comma-separated list of them")
    p.add_argument("--spread", action="store_true",
                   help="with --families: HF's own bf16 deviation with eager and with SDPA attention")
    p.add_argument("--moe-seeds", default=None,
                   help="with --families: the MoE families' tiny weights drawn with each of these seeds (e.g. 3,4,5)")
    p.add_argument("--router-noise", action="store_true",
                   help="with --families: each MoE row also prints its routers' logit error, per engine")
    p.add_argument("--layer-trace", action="store_true",
                   help="with --families: each MoE row also prints the stream's error after every layer, per engine")
    p.add_argument("--forced-routing", action="store_true",
                   help="with --families: each MoE row also with every bf16 run routed as its float32 run; "
                        "that table is the row's verdict")
    p.add_argument("--tail", action="store_true",
                   help="with --families: the positions behind each MoE row's p99 / max and the flips before them")
    p.add_argument("--moe-sequences", type=int, default=4, help="with --families: sequences of 40 tokens per MoE row")
    p.add_argument("--backends", default=None, help="comma-separated subset of torch,triton (default: both on CUDA)")
    p.add_argument("--qk-kernel", action="store_true",
                   help="check the q/k norm + rotary Triton kernel against its torch reference first (CUDA)")
    p.add_argument("--smollm2", default=None, help="also the real SmolLM2: path of its GGUF")
    ns = p.parse_args(argv)
    global BACKENDS
    BACKENDS = set(ns.backends.split(",")) if ns.backends else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # float32 references in float32: no TF32 in any matmul or convolution (HF's or tokenmill's).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if not ns.smoke and device != "cuda":
        print("no CUDA device: use --smoke on CPU", file=sys.stderr)
        return 2
    shapes = SMOKE_SHAPES if ns.smoke else SHAPES
    if ns.shapes:
        shapes = {} if ns.shapes == "none" else {k: shapes[k] for k in ns.shapes.split(",")}
    num, prompt_len, total = (2, 4, 12) if ns.smoke else (16, 8, 64)
    records, spreads = [], []
    if ns.qk_kernel and device == "cuda":
        from tokenmill.layers import qk_norm
        print(f"cuBLAS bf16 -> float32 matmul (q/k norm from the float32 projection): "
              f"{qk_norm._cuda_mm_f32_works()}", flush=True)
        records.append(check_qk_kernel(device))
    for name, shape in shapes.items():
        records += run_shape(name, shape, device, num, prompt_len, total)
    out_dir = os.environ.get("OUT", "./gpu-out")
    os.makedirs(out_dir, exist_ok=True)

    machine = machine_info()

    def save(rows: list[dict], partial: bool) -> dict:
        """The JSON record, rewritten after every row (a job killed at its limit keeps what it did)."""
        result = {"script": "gpu_bf16", "smoke": ns.smoke, "device": device, "tolerance": TOLERANCE,
                  "argv": sys.argv[1:], "partial": partial, "machine": machine, "versions": versions(),
                  "records": rows, "hf_spread": spreads,
                  "ok": all(r["ok"] for r in rows if r.get("judged", True))}
        with open(os.path.join(out_dir, "gpu_bf16.json"), "w") as f:
            json.dump(result, f, indent=2)
        return result

    if ns.families:
        only = None if ns.families == "all" else set(ns.families.split(","))
        seeds = [int(v) for v in ns.moe_seeds.split(",")] if ns.moe_seeds else None
        family_records, spreads = run_families(device, ns.smoke, only, ns.spread, seeds, ns.router_noise,
                                               ns.layer_trace, ns.forced_routing, ns.tail, ns.moe_sequences,
                                               on_row=lambda rows: save(records + rows, partial=True))
        records += family_records
    if ns.smollm2:
        records += run_smollm2(ns.smollm2, device)
    result = save(records, partial=False)
    judged = [r for r in records if r.get("judged", True)]
    print(json.dumps({"ok": result["ok"], "worst_ratio": max((r.get("worst_ratio", 0.0) for r in judged), default=0.0)}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
