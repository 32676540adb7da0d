"""Where a bf16 deviation comes from: per-layer and per-router diagnostics beside the deviation
table of `bf16_deviation` (which says how large it is).

- `layer_errors`: the residual stream's relative error after every decoder layer, each engine's
  bf16 run against its own float32 run.
- `router_logit_errors`: how far each MoE router's logits move in bf16 (from its bf16 input).
- `forced_routing`: the deviation table with each bf16 run routed as its own float32 run routed
  (every router's expert choice imposed; the weights still come from the bf16 run's own logits).
  A choice that flips in bf16 is a discrete event whose effect reaches later positions through
  attention; with the choices held, what remains is the arithmetic alone, at every position.
- `tail_positions`: the positions behind the table's p99 / max, with each engine's routing flips
  before them in the same sequence (is a tail the arithmetic, or a flip's echo?).

Every function loads its four models (tokenmill / HF x float32 / bf16) from a checkpoint path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.benchmarks.bf16_deviation import (MODES, DeviationReport, Stats, hf_logits, hf_routes, hooked,
                                                 load_hf_pair, load_tokenmill, router_margins, routing_flips,
                                                 target_logprobs, tokenmill_logits, tokenmill_routes)
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend

F32, BF16 = torch.float32, torch.bfloat16


def _load_four(path: str, device: str, attn_backend_cls: type[AttentionBackend]):
    tm = {d: load_tokenmill(path, d, device, attn_backend_cls) for d in (F32, BF16)}  # (not inference tensors)
    return tm, load_hf_pair(path, device)


def _tm_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from tokenmill.layers.moe.layer import Router
    return [m for m in model.modules() if isinstance(m, Router)]


def _hf_routers(hf_model) -> list[torch.nn.Module]:
    """HF's router modules (`*.mlp.gate` / `*.mlp.router` holding a [E, H] weight), in layer order."""
    return [m for name, m in hf_model.named_modules() if name.endswith(("mlp.gate", "mlp.router"))
            and getattr(m, "weight", None) is not None and m.weight.dim() == 2]


def _per_layer_errors(path, sequences, device, attn_backend_cls, modes, tm_run, hf_run, diff
                      ) -> dict[str, list[list[torch.Tensor]]]:
    """Each engine's bf16 run against its own float32 run, per hooked layer: `diff(bf16, f32)` of the
    tensors `tm_run(model, ids, mode)` / `hf_run(model, ids)` return, listed over `sequences`.
    Keys "hf" and "tokenmill MODE"."""
    tm, hf = _load_four(path, device, attn_backend_cls)
    errors: dict[str, list[list[torch.Tensor]]] = {}
    for ids in sequences:
        runs = {"hf": (hf_run(hf[BF16], ids), hf_run(hf[F32], ids))}
        runs.update({f"tokenmill {m}": (tm_run(tm[BF16], ids, m), tm_run(tm[F32], ids, m)) for m in modes})
        for run, (low, ref) in runs.items():
            per_layer = errors.setdefault(run, [[] for _ in ref])
            for i, (a, b) in enumerate(zip(low, ref)):
                per_layer[i].append(diff(a, b))
    return errors


def router_logit_errors(path: str, sequences: Sequence[Sequence[int]], device: str = "cpu",
                        attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend,
                        modes: Sequence[str] = MODES) -> dict[str, list[dict[str, float]]]:
    """How noisy each engine's bf16 router input is: per MoE layer (in order), quantiles (p50 / p90 /
    p99) of |logits of the bf16 run - logits of the float32 run| over every position and expert,
    both computed in float32 from each run's own router input and weights (so the router's own
    arithmetic is left out). Keys: "hf" and "tokenmill MODE"."""

    def f32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), weight.float())

    def tm_run(model, ids, mode) -> list[torch.Tensor]:
        routers = _tm_routers(model)
        calls: dict[int, list[torch.Tensor]] = {id(r): [] for r in routers}
        with hooked(r.register_forward_pre_hook(lambda mod, a: calls[id(mod)].append(f32_logits(a[0], mod.weight)))
                    for r in routers):
            tokenmill_logits(model, ids, mode)
        return [torch.cat(calls[id(r)]) for r in routers]

    def hf_run(model, ids) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        with hooked(g.register_forward_pre_hook(lambda mod, a: out.append(f32_logits(a[0], mod.weight)))
                    for g in _hf_routers(model)):
            hf_logits(model, ids)
        return out

    errors = _per_layer_errors(path, sequences, device, attn_backend_cls, modes, tm_run, hf_run,
                               lambda a, b: (a - b).abs().flatten().double().cpu())
    return {run: [{f"p{int(q * 100)}": float(torch.quantile(torch.cat(e), q)) for q in (0.5, 0.9, 0.99)}
                  for e in layers] for run, layers in errors.items()}


def layer_errors(path: str, sequences: Sequence[Sequence[int]], device: str = "cpu",
                 attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend,
                 modes: Sequence[str] = MODES) -> dict[str, list[float]]:
    """Where bf16 error enters, layer by layer: the mean over positions of |stream_bf16 - stream_f32| /
    |stream_f32| for the residual stream after each decoder layer (HF: the layer's output; tokenmill:
    its hidden + residual), each engine against its own float32 run. Keys "hf" and "tokenmill MODE"."""

    def tm_run(model, ids, mode) -> list[torch.Tensor]:
        layers = [m for m in model.model.layers if len(list(m.parameters()))]
        out: list[list[torch.Tensor]] = [[] for _ in layers]

        def hook(i):
            def fn(mod, args, result):
                hidden, residual = result
                out[i].append(hidden.double() + (0 if residual is None else residual.double()))
            return fn

        with hooked(m.register_forward_hook(hook(i)) for i, m in enumerate(layers)):
            tokenmill_logits(model, ids, mode)
        return [torch.cat(o) for o in out]

    def hf_run(model, ids) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        with hooked(m.register_forward_hook(
                lambda mod, a, result: out.append((result[0] if isinstance(result, tuple) else result)[0].double()))
                for m in model.model.layers):
            hf_logits(model, ids)
        return out

    errors = _per_layer_errors(path, sequences, device, attn_backend_cls, modes, tm_run, hf_run,
                               lambda a, b: ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).cpu())
    return {run: [float(torch.cat(e).mean()) for e in layers] for run, layers in errors.items()}


class _RouteTape:
    """Each router's expert ids [rows, k] over one run, recorded in call order (`record`) and
    replayed in the same order into another run of the same sequence (`cursor` rows consumed)."""

    def __init__(self, routers: Sequence[torch.nn.Module]) -> None:
        self.index = {id(r): i for i, r in enumerate(routers)}
        self.ids: list[list[torch.Tensor]] = [[] for _ in routers]
        self.cursor = [0] * len(routers)

    def record(self, router: torch.nn.Module, ids: torch.Tensor) -> None:
        self.ids[self.index[id(router)]].append(ids.reshape(-1, ids.shape[-1]).detach())

    def replay(self, router: torch.nn.Module, rows: int) -> torch.Tensor:
        i = self.index[id(router)]
        tape = torch.cat(self.ids[i])
        start = self.cursor[i]
        if start + rows > tape.shape[0]:
            raise RuntimeError(f"router {i}: the bf16 run routes more rows than the float32 run recorded")
        self.cursor[i] += rows
        return tape[start:start + rows]


def _tm_forced_logits(models: dict, ids: Sequence[int], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits, bf16 logits) of tokenmill, the bf16 run routed as the float32 run routed."""
    from tokenmill.layers.moe import routing
    tape = _RouteTape(_tm_routers(models[F32]))
    with hooked(r.register_forward_hook(lambda mod, args, out: tape.record(mod, out[1]))
                for r in _tm_routers(models[F32])):
        ref = tokenmill_logits(models[F32], ids, mode)
    low_routers = _tm_routers(models[BF16])
    tape.index = {id(r): i for i, r in enumerate(low_routers)}

    def impose(mod, args, out):
        forced = tape.replay(mod, args[0].shape[0]).to(out[1].device)
        logits = torch.nn.functional.linear(args[0].float(), mod.weight.float(),
                                            None if mod.bias is None else mod.bias.float())
        return routing.expert_weights(logits, mod.moe, forced), forced

    with hooked(r.register_forward_hook(impose) for r in low_routers):
        low = tokenmill_logits(models[BF16], ids, mode)
    return ref, low


def _hf_forced_logits(models: dict, ids: Sequence[int], moe) -> tuple[torch.Tensor, torch.Tensor]:
    """As `_tm_forced_logits` for HF: routers returning (logits, top-k weights, top-k ids) (HF 5.x's
    `*TopKRouter`s); the imposed experts' weights by `routing.expert_weights` (each family's rule)
    from HF's own router logits, rounded to the dtype HF's weights had."""
    from tokenmill.layers.moe import routing
    tape = _RouteTape(_hf_routers(models[F32]))

    def record(mod, args, out):
        if not (isinstance(out, tuple) and len(out) == 3 and out[1].shape == out[2].shape):
            raise NotImplementedError(f"{type(mod).__name__} does not return (logits, top-k weights, top-k ids)")
        tape.record(mod, out[2])

    with hooked(g.register_forward_hook(record) for g in _hf_routers(models[F32])):
        ref = hf_logits(models[F32], ids)
    low_routers = _hf_routers(models[BF16])
    tape.index = {id(r): i for i, r in enumerate(low_routers)}

    def impose(mod, args, out):
        logits, weights, _ = out
        forced = tape.replay(mod, logits.reshape(-1, logits.shape[-1]).shape[0]).to(logits.device)
        return logits, routing.expert_weights(logits, moe, forced).to(weights.dtype), forced

    with hooked(g.register_forward_hook(impose) for g in low_routers):
        low = hf_logits(models[BF16], ids)
    return ref, low


@torch.inference_mode()
def forced_routing(path: str, sequences: Sequence[Sequence[int]], label: str | None = None, device: str = "cpu",
                   attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend,
                   modes: Sequence[str] = MODES) -> DeviationReport:
    """The deviation table of an MoE checkpoint with every bf16 run routed as its own float32 run
    (see the module doc): every position scored, none left out."""
    tm, hf = _load_four(path, device, attn_backend_cls)
    moe = tm[F32].dims.moe
    hf_dev, tm_dev, gap = [], {m: [] for m in modes}, 0.0
    for ids in sequences:
        h32, h16 = _hf_forced_logits(hf, ids, moe)
        hf_ref = target_logprobs(h32, ids)
        hf_dev.append(target_logprobs(h16, ids) - hf_ref)
        for mode in modes:
            t32, t16 = _tm_forced_logits(tm, ids, mode)
            ref = target_logprobs(t32.float(), ids)
            gap = max(gap, float((ref - hf_ref).abs().max()))
            tm_dev[mode].append(target_logprobs(t16.float(), ids) - ref)
    return DeviationReport(label=label or f"{path.rstrip('/').rsplit('/', 1)[-1]} forced routing",
                           tokens=sum(len(s) - 1 for s in sequences), float32_gap=gap,
                           hf=Stats.of(torch.cat(hf_dev)), tokenmill={m: Stats.of(torch.cat(d)) for m, d in tm_dev.items()})


@torch.inference_mode()
def tail_positions(path: str, sequences: Sequence[Sequence[int]], device: str = "cpu",
                   attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend, mode: str = "prefill",
                   tie_margin: float = 0.1, top: int = 5) -> dict[str, list[dict]]:
    """The `top` largest |deviation| positions of each engine's bf16 run (tokenmill in `mode`) that
    the deviation table keeps (no float32 near tie, no flip there), each with both engines'
    deviations there, its float32 routing margin and the positions earlier in its sequence where
    each engine's bf16 routing flipped. Keys "hf" and "tokenmill"."""
    tm, hf = _load_four(path, device, attn_backend_cls)
    moe = tm[F32].dims.moe
    rows: list[dict] = []
    for s, ids in enumerate(sequences):
        (h32, hr32), (h16, hr16) = (hf_routes(hf[d], ids, moe) for d in (F32, BF16))
        (t32, tr32), (t16, tr16) = (tokenmill_routes(tm[d], ids, mode) for d in (F32, BF16))
        margins = router_margins(tm[F32], ids)
        flips = {"hf": routing_flips(hr16, hr32), "tokenmill": routing_flips(tr16, tr32)}
        dev = {"hf": (target_logprobs(h16, ids) - target_logprobs(h32, ids)).abs().cpu(),
               "tokenmill": (target_logprobs(t16.float(), ids) - target_logprobs(t32.float(), ids)).abs().cpu()}
        for p in range(len(ids) - 1):
            if margins[p] < tie_margin or flips["hf"][p] or flips["tokenmill"][p]:
                continue
            rows.append({"sequence": s, "position": p, "margin": float(margins[p]),
                         **{f"{run}_deviation": float(d[p]) for run, d in dev.items()},
                         **{f"{run}_flips_before": [int(i) for i in f[:p].nonzero().flatten()]
                            for run, f in flips.items()}})
    return {run: sorted(rows, key=lambda r, k=f"{run}_deviation": -r[k])[:top] for run in ("hf", "tokenmill")}


def format_tail(label: str, tails: dict[str, list[dict]]) -> str:
    lines = []
    for run, rows in tails.items():
        for r in rows:
            lines.append(f"{label} {run:>9} tail: seq {r['sequence']} pos {r['position']:>2}  hf {r['hf_deviation']:.3f}"
                         f"  tm {r['tokenmill_deviation']:.3f}  margin {r['margin']:.2f}  flips before: hf "
                         f"{r['hf_flips_before']} tm {r['tokenmill_flips_before']}")
    return "\n".join(lines)

