"""Fused Triton ops (RMSNorm + residual add, rotary, SiLU-and-mul) on a CUDA GPU: correctness, graphs, timings.

    python scripts/fused_ops_check.py

(a) Correctness of each fused op against the torch code path it replaces (the same layer code with
    `triton_ops.enabled` forced off), in bf16, fp16 and fp32, at the Llama-3.2-1B and Llama-3.1-8B
    shapes, for 1, 64 and 256 tokens; plus Qwen3-style q/k norm over strided heads and rotary of a
    separate q/k pair. bf16/fp16: every element within 2 units in the last place of the torch
    result and >= 99.9% within one (the mean square's last bit may round the reciprocal root the
    other way, for a whole row); fp32: max error <= 2e-6 of the largest magnitude. The new
    residual must match bit for bit, and everything an op must not write must stay as it was.
(b) CUDA-graph replay: each fused op captured once, replayed over new inputs (new positions too).
(c) Timings in bf16: a CUDA graph of 100 calls, µs per call, torch path vs fused, and their sum
    over one decoder layer (2 x add+norm, rotary, SiLU-and-mul) times the layer count.

Prints a compact table and one JSON line; writes $OUT/fused_ops_check.json when $OUT is set;
exits 1 when any check fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.benchmarks.graph_timing import graph_us  # noqa: E402
from tokenmill.config import RopeConfig  # noqa: E402
from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.activation import SiluAndMul  # noqa: E402
from tokenmill.layers.norm import RMSNorm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int


MODELS = {
    "llama3.2-1b": Shape(2048, 32, 8, 64, 8192, 16),
    "llama3.1-8b": Shape(4096, 32, 8, 128, 14336, 32),
}
TOKENS = (1, 64, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_POSITION = 8192
FP32_TOL = 2e-6
MIN_WITHIN_ONE_ULP = 0.999
GRAPH_CALLS = 100
DEV = torch.device("cuda")


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """The layers' torch code paths on CUDA tensors (what ran before the fused kernels)."""
    saved = triton_ops.enabled
    triton_ops.enabled = lambda x: False
    try:
        yield
    finally:
        triton_ops.enabled = saved


@dataclasses.dataclass
class Inputs:
    shape: Shape
    x: torch.Tensor  # [T, hidden]: a sublayer's output
    residual: torch.Tensor  # [T, hidden]
    qkv: torch.Tensor  # [T, (H + 2 Hkv) * D]
    positions: torch.Tensor  # int64 [T], not 16-byte aligned
    gate_up: torch.Tensor  # [T, 2 * intermediate]
    norm: RMSNorm
    head_norm: RMSNorm  # Qwen3's q/k norm over head_dim
    rope: RotaryEmbedding
    act: SiluAndMul

    def qk(self, qkv: torch.Tensor) -> torch.Tensor:
        s = self.shape
        return qkv[:, :(s.num_heads + s.num_kv_heads) * s.head_dim].view(
            qkv.shape[0], s.num_heads + s.num_kv_heads, s.head_dim)

    def q_and_k(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, t = self.shape, qkv.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return (qkv[:, :q_size].view(t, s.num_heads, s.head_dim),
                qkv[:, q_size:q_size + kv_size].view(t, s.num_kv_heads, s.head_dim))


def make_inputs(shape: Shape, tokens: int, dtype: torch.dtype, seed: int = 0) -> Inputs:
    torch.manual_seed(seed)
    norm, head_norm = RMSNorm(shape.hidden, 1e-5), RMSNorm(shape.head_dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(shape.hidden))
        head_norm.weight.copy_(1 + 0.3 * torch.randn(shape.head_dim))
    rope = RotaryEmbedding(shape.head_dim, MAX_POSITION, RopeConfig(theta=500000.0))
    qkv_width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    return Inputs(
        shape=shape,
        x=torch.randn(tokens, shape.hidden, device=DEV).to(dtype),
        residual=(4 * torch.randn(tokens, shape.hidden, device=DEV)).to(dtype),
        qkv=torch.randn(tokens, qkv_width, device=DEV).to(dtype),
        # A view one element into a larger buffer, as eager steps slice positions out of a packed upload.
        positions=torch.randint(0, MAX_POSITION, (tokens + 1,), device=DEV)[1:],
        gate_up=(3 * torch.randn(tokens, 2 * shape.intermediate, device=DEV)).to(dtype),
        norm=norm.to(DEV, dtype), head_norm=head_norm.to(DEV, dtype), rope=rope.to(DEV), act=SiluAndMul())


# ---------------------------------------------------------------- (a) correctness

def ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """float32 spacing of `magnitude`'s half type just above each value (subnormal spacing at least)."""
    info = torch.finfo(magnitude.dtype)
    _, exponent = torch.frexp(magnitude.float())  # magnitude = m * 2**exponent, m in [0.5, 1)
    spacing = torch.ldexp(torch.full_like(magnitude, info.eps, dtype=torch.float32), exponent - 1)
    smallest = info.smallest_normal * info.eps
    return torch.where(magnitude == 0, smallest, spacing.clamp_min(smallest))


def compare(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Distance of the fused result from the torch path's, in ulps (half types) or relative (fp32)."""
    if expected.dtype == torch.float32:
        err = ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
        return dict(rel_err=err, exact=(actual == expected).float().mean().item(), ok=err <= FP32_TOL)
    ulps = (actual.float() - expected.float()).abs() / ulp(torch.maximum(actual.abs(), expected.abs()))
    max_ulps, within_one = ulps.max().item(), (ulps <= 1).float().mean().item()
    return dict(max_ulps=max_ulps, within_one_ulp=within_one, exact=(actual == expected).float().mean().item(),
                ok=max_ulps <= 2 and within_one >= MIN_WITHIN_ONE_ULP)


def merge(*results: dict) -> dict:
    """The worst of several comparisons (e.g. q and k, or output and residual)."""
    out = dict(results[0])
    for r in results[1:]:
        out["ok"] = out["ok"] and r["ok"]
        out["exact"] = min(out["exact"], r["exact"])
        for key in ("rel_err", "max_ulps"):
            if key in r:
                out[key] = max(out[key], r[key])
        if "within_one_ulp" in r:
            out["within_one_ulp"] = min(out["within_one_ulp"], r["within_one_ulp"])
    return out


def check_ops(inp: Inputs) -> dict[str, dict]:
    results = {}
    results["rms_norm"] = compare(inp.norm(inp.x), ref(lambda: inp.norm(inp.x)))

    x_before = inp.x.clone()
    residual = inp.residual.clone()
    out, new_residual = inp.norm.forward_with_residual(inp.x, residual)
    ref_out, ref_residual = ref(lambda: inp.norm.forward_with_residual(inp.x, inp.residual.clone()))
    r = compare(out, ref_out)
    r["ok"] = r["ok"] and new_residual is residual and torch.equal(residual, ref_residual) \
        and torch.equal(inp.x, x_before)
    results["add_rms_norm"] = r

    qkv = inp.qkv.clone()
    ref_qk = ref(lambda: inp.rope.prepare(inp.positions, qkv.dtype).rotate(inp.qk(inp.qkv)))
    inp.rope.prepare(inp.positions, qkv.dtype).rotate(inp.qk(qkv))
    r = compare(inp.qk(qkv), ref_qk)
    v_from = ref_qk.shape[1] * ref_qk.shape[2]
    r["ok"] = r["ok"] and torch.equal(qkv[:, v_from:], inp.qkv[:, v_from:])
    results["rotary"] = r

    results["silu_and_mul"] = compare(inp.act(inp.gate_up), ref(lambda: inp.act(inp.gate_up)))

    # Qwen3: q/k norm over the heads inside qkv (strided), then q and k rotated as a pair.
    q, k = inp.q_and_k(inp.qkv)
    qn, kn = inp.head_norm(q), inp.head_norm(k)
    ref_qn, ref_kn = ref(lambda: (inp.head_norm(q), inp.head_norm(k)))
    step = inp.rope.prepare(inp.positions, qn.dtype)
    ref_step = ref(lambda: inp.rope.prepare(inp.positions, qn.dtype))
    normed = merge(compare(qn, ref_qn), compare(kn, ref_kn))
    qr, kr = step.rotate_pair(ref_qn.clone(), ref_kn.clone())  # same inputs for both paths
    ref_qr, ref_kr = ref(lambda: ref_step.rotate_pair(ref_qn, ref_kn))
    results["qk_norm+rotary_pair"] = merge(normed, compare(qr, ref_qr), compare(kr, ref_kr))
    return results


def ref(fn: Callable):
    with torch_path():
        return fn()


def correctness() -> list[dict]:
    rows = []
    for model, shape in MODELS.items():
        for dtype in DTYPES:
            for tokens in TOKENS:
                inp = make_inputs(shape, tokens, dtype, seed=tokens)
                for op, r in check_ops(inp).items():
                    rows.append(dict(op=op, model=model, dtype=str(dtype).split(".")[-1], tokens=tokens, **r))
    return rows


# ---------------------------------------------------------------- (b) CUDA-graph replay

def graph_replay(model: str = "llama3.2-1b", tokens: int = 64, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Each fused op captured once over static buffers, replayed twice over new contents."""
    inp = make_inputs(MODELS[model], tokens, dtype, seed=1)
    x, residual, qkv, positions, gate_up = inp.x, inp.residual, inp.qkv, inp.positions, inp.gate_up

    def body():
        normed, _ = inp.norm.forward_with_residual(x, residual)
        inp.rope.prepare(positions, dtype).rotate(inp.qk(qkv))
        return normed, inp.act(gate_up)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, act = body()
    results = []
    for step in range(2):
        new = make_inputs(MODELS[model], tokens, dtype, seed=10 + step)
        for dst, src in ((x, new.x), (residual, new.residual), (qkv, new.qkv), (positions, new.positions),
                         (gate_up, new.gate_up)):
            dst.copy_(src)
        ref_normed, ref_residual = ref(lambda: inp.norm.forward_with_residual(new.x, new.residual))
        ref_qk = ref(lambda: inp.rope.prepare(new.positions, dtype).rotate(inp.qk(new.qkv)))
        ref_act = ref(lambda: inp.act(new.gate_up))
        graph.replay()
        r = merge(compare(normed, ref_normed), compare(inp.qk(qkv), ref_qk), compare(act, ref_act))
        r["ok"] = r["ok"] and torch.equal(residual, ref_residual)
        results.append(dict(case=f"graph replay {step} ({model}, {tokens} tokens)", **r))
    return results


# ---------------------------------------------------------------- (c) timings

def time_graph(fn: Callable[[], object], calls: int = GRAPH_CALLS, replays: int = 5) -> float:
    """µs per call of `fn`, from replays of one CUDA graph holding `calls` calls."""
    return graph_us(fn, calls=calls, replays=replays, warmup=2)


def op_bodies(inp: Inputs, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """One layer's ops as the model runs them; under `torch_path` the rotary gets its cos/sin gathered
    once (per step, as the model does), outside the timed body."""
    step = inp.rope.prepare(inp.positions, dtype)
    return {
        "rms_norm": lambda: inp.norm(inp.x),
        "add_rms_norm": lambda: inp.norm.forward_with_residual(inp.x, inp.residual),
        "rotary": lambda: step.rotate(inp.qk(inp.qkv)),
        "silu_and_mul": lambda: inp.act(inp.gate_up),
    }


def timings(dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    rows = []
    for model, shape in MODELS.items():
        for tokens in TOKENS:
            inp = make_inputs(shape, tokens, dtype)
            fused = {op: time_graph(fn) for op, fn in op_bodies(inp, dtype).items()}
            with torch_path():
                torch_us = {op: time_graph(fn) for op, fn in op_bodies(inp, dtype).items()}
                gather_us = time_graph(lambda: inp.rope.prepare(inp.positions, dtype))
            for op in fused:
                rows.append(dict(model=model, tokens=tokens, op=op, torch_us=torch_us[op], fused_us=fused[op]))
            layer = ("add_rms_norm", "add_rms_norm", "rotary", "silu_and_mul")
            torch_step = sum(torch_us[op] for op in layer) * shape.num_layers + gather_us
            fused_step = sum(fused[op] for op in layer) * shape.num_layers
            rows.append(dict(model=model, tokens=tokens, op=f"per step ({shape.num_layers} layers + cos/sin gather)",
                             torch_us=torch_step, fused_us=fused_step))
    return rows


# ---------------------------------------------------------------- main

@torch.inference_mode()
def main() -> int:
    import triton
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(DEV)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}")
    report: dict = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__}

    report["correctness"] = correctness()
    print(f"\n{'op':<22}{'model':<14}{'dtype':<10}{'T':>5}{'max ulps':>10}{'<=1 ulp':>9}{'rel err':>10}"
          f"{'exact':>8}  ok")
    for r in report["correctness"]:
        ulps = f"{r['max_ulps']:>10.2f}{r['within_one_ulp']:>9.4f}{'':>10}" if "max_ulps" in r else \
            f"{'':>10}{'':>9}{r['rel_err']:>10.1e}"
        print(f"{r['op']:<22}{r['model']:<14}{r['dtype']:<10}{r['tokens']:>5}{ulps}{r['exact']:>8.4f}  "
              f"{'ok' if r['ok'] else 'FAIL'}")
    print(f"(correctness: {time.perf_counter() - start:.0f} s so far)")

    report["graph_replay"] = graph_replay()
    for r in report["graph_replay"]:
        print(f"{r['case']:<44} max ulps {r['max_ulps']:.2f}  {'ok' if r['ok'] else 'FAIL'}")

    report["timings"] = timings()
    print(f"\nbf16, µs per call (CUDA graph of {GRAPH_CALLS} calls)")
    print(f"{'model':<14}{'T':>5}  {'op':<40}{'torch':>9}{'fused':>9}{'speed-up':>10}")
    for r in report["timings"]:
        print(f"{r['model']:<14}{r['tokens']:>5}  {r['op']:<40}{r['torch_us']:>9.1f}{r['fused_us']:>9.1f}"
              f"{r['torch_us'] / r['fused_us']:>9.1f}x")

    report["all_ok"] = all(r["ok"] for r in report["correctness"] + report["graph_replay"])
    report["seconds"] = time.perf_counter() - start
    line = json.dumps(report)
    print("\n" + line)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "fused_ops_check.json"), "w") as f:
            f.write(line + "\n")
    print(f"\n{'ALL OK' if report['all_ok'] else 'FAILURES'} in {report['seconds']:.0f} s")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
