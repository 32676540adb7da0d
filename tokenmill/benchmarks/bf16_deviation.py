"""Teacher-forced bfloat16 deviation: how far tokenmill's bf16 and HF transformers' bf16 land from float32.

The same token sequences go through four models on the same weights: tokenmill float32, tokenmill
bfloat16, HF float32 and HF bfloat16. At every position the log-probability of the true next token
is taken (teacher forcing: each model sees the given tokens, never its own picks), and each bf16
run is compared with its own float32 run: the table reports mean / p99 / max |deviation| in nats.
tokenmill's bf16 should not deviate more than HF's (`check_not_worse`).

Mixture-of-experts models: a router's top-k choice that is a near tie in float32 can flip in either
engine's bf16 run, a jump of up to ~1 nat at that token that says nothing about the numerics
(HF's bf16 may or may not make the same jump). With `tie_margin`, positions left out of every
run's statistics: those where the float32 routing decision is a near tie in some layer
(`router_margins`), and those where either engine's bf16 run chose other experts than its float32
run did (`routing_flips`: only a near tie relative to bf16's noise on the router logits flips);
at most `max_excluded` of them (more raises: the check would say too little). The report counts
them, and the flips of each engine.

tokenmill is driven two ways over its paged KV cache: "prefill" (the whole sequence in one step:
the prompt-logprobs path) and "decode" (one token per step after the first: the decode attention
path). HF runs a plain forward over the whole sequence.

    python -m tokenmill.benchmarks.bf16_deviation --model smollm2 [--model DIR ...] [--output-json F]
    tokenmill bench bf16-deviation --model smollm2

Rows go to the device the models run on (`--device`, default cpu). Where a deviation comes from
(per-layer and router errors, forced routing, the positions behind a tail): `bf16_diagnostics`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Sequence

import torch

from tokenmill.layers.attention.backend import AttentionBackend, kv_cache_shape
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend

MODES = ("prefill", "decode")
# ~110 tokens of plain English (SmolLM2's tokenizer): the real-model check's default text.
SAMPLE_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small can of oil "
    "and a cloth for the lens. From the gallery he could see the fishing boats returning to the harbour, "
    "their lanterns swaying with the swell. He wrote the weather in a leather book: wind from the west, "
    "a light rain after midnight, and fog expected before the morning tide. When the last boat was in, "
    "he made tea on the iron stove, read a chapter of an old novel about sailors, and listened to the "
    "sea until the clock struck ten."
)


@contextlib.contextmanager
def hooked(handles: Iterable[torch.utils.hooks.RemovableHandle]) -> Iterator[list]:
    """Holds module hooks (the handles `register_forward_hook` and kin return) for a `with` block
    and removes every one of them on the way out, raised or not."""
    held = list(handles)
    try:
        yield held
    finally:
        for h in held:
            h.remove()


@dataclasses.dataclass(frozen=True)
class Stats:
    """|deviation| in nats over every scored position."""

    mean: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, deviation: torch.Tensor) -> "Stats":
        d = deviation.detach().abs().double().flatten().cpu()
        return cls(float(d.mean()), float(torch.quantile(d, 0.99)), float(d.max()), d.numel())


@dataclasses.dataclass(frozen=True)
class DeviationReport:
    label: str
    tokens: int  # scored positions per run
    float32_gap: float  # max |tokenmill float32 - HF float32| (the two references agree)
    hf: Stats
    tokenmill: dict[str, Stats]  # by mode
    excluded: int = 0  # positions left out: a float32 routing near tie or a bf16 routing flip
    flips: dict[str, int] = dataclasses.field(default_factory=dict)  # positions whose bf16 routing flipped, by run

    def worst_ratio(self) -> float:
        """The largest tokenmill / HF ratio over the modes and the three statistics."""
        return max(getattr(s, f) / max(getattr(self.hf, f), 1e-12)
                   for s in self.tokenmill.values() for f in ("mean", "p99", "max"))

    def as_dict(self) -> dict:
        return {"label": self.label, "tokens": self.tokens, "float32_gap": self.float32_gap, "excluded": self.excluded,
                "routing_flips": self.flips,
                "hf_bf16": dataclasses.asdict(self.hf),
                "tokenmill_bf16": {m: dataclasses.asdict(s) for m, s in self.tokenmill.items()}}


def target_logprobs(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """float32 [L - 1]: log p(token i+1 | tokens <= i) from logits [L, V] (row i predicts token i+1)."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(list(token_ids[1:]), device=logits.device)[:, None]
    return lp.gather(1, target).squeeze(1)


@torch.inference_mode()
def hf_logits(hf_model, token_ids: Sequence[int]) -> torch.Tensor:
    """[L, V] logits of a HF causal LM over one sequence (a single forward)."""
    device = next(hf_model.parameters()).device
    return hf_model(input_ids=torch.tensor([list(token_ids)], device=device)).logits[0]


class _OneSequence:
    """Runs one sequence through a tokenmill model over a private paged KV cache."""

    def __init__(self, model: torch.nn.Module, max_len: int, block_size: int = 16) -> None:
        dims = model.dims
        param = next(model.parameters())
        self.model, self.block_size, self.device = model, block_size, param.device
        num_blocks = -(-max_len // block_size)
        # Blocks in reverse order: the table is not the identity, so paging mistakes show.
        self.block_table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32, device=self.device)[None]
        if dims.mla is not None:  # latent attention caches [c | k_pe] per token
            from tokenmill.layers.attention.mla import mla_cache_shape
            shape = mla_cache_shape(num_blocks, block_size, dims.mla.latent_dim)
        else:
            shape = kv_cache_shape(num_blocks, block_size, dims.num_kv_heads, dims.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=param.dtype, device=self.device) for _ in range(dims.num_layers)]

    def step(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Computes tokens at positions start.. (earlier ones are cached); returns their logits [n, V]."""
        n, end = len(token_ids), start + len(token_ids)
        positions = torch.arange(start, end, device=self.device)
        table = self.block_table[0].long()
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq_lens = torch.tensor([end], dtype=torch.int32)
        meta = AttentionMetadata(num_tokens=n, max_query_len=n, max_seq_len=end,
                                 query_start_loc=qsl.to(self.device), seq_lens=seq_lens.to(self.device),
                                 block_table=self.block_table, slot_mapping=slots,
                                 query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        ids = torch.tensor(list(token_ids), device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)


@torch.inference_mode()
def tokenmill_logits(model: torch.nn.Module, token_ids: Sequence[int], mode: str) -> torch.Tensor:
    """[L, V] float32 logits of a tokenmill model over one sequence: one prefill step ("prefill"),
    or the first token then one token per step ("decode")."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    run = _OneSequence(model, len(token_ids))
    if mode == "prefill":
        return run.step(token_ids, 0).float()
    return torch.cat([run.step(token_ids[i:i + 1], i).float() for i in range(len(token_ids))])


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids` by a tokenmill model (one prefill, then decode steps)."""
    run = _OneSequence(model, len(prompt_ids) + max_new_tokens)
    logits = run.step(prompt_ids, 0)[-1]
    out: list[int] = []
    for i in range(max_new_tokens):
        out.append(int(logits.argmax()))
        if i + 1 < max_new_tokens:
            logits = run.step(out[-1:], len(prompt_ids) + i)[-1]
    return out


def load_tokenmill(path: str, dtype: torch.dtype, device: str = "cpu",
                   attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend) -> torch.nn.Module:
    from tokenmill.model.arch import model_arch
    from tokenmill.model.hf_config import load_hf_config
    from tokenmill.model.loader import load_model
    return load_model(path, model_arch(load_hf_config(path)), "auto", dtype, torch.device(device), attn_backend_cls)


def tokenmill_from_hf(hf_model, dtype: torch.dtype, device: str | torch.device,
                      attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend) -> torch.nn.Module:
    """A tokenmill model holding an in-memory HF model's weights (rounded to `dtype`), no files."""
    from tokenmill.model.arch import model_arch
    from tokenmill.model.registry import get_model_class
    arch = model_arch(hf_model.config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = get_model_class(arch.architecture)(arch, attn_backend_cls)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=torch.device(device))
    model.load_weights((name, t.detach()) for name, t in hf_model.state_dict().items())
    return model.eval()


def hf_attention(path: str) -> str | None:
    """The attention implementation the HF reference must use for a HF directory: "eager" where
    the config soft-caps attention logits (Gemma 2), else None (transformers' default).

    Why: transformers 5.17 declares SDPA support for Gemma 2 and picks it by default, and its
    SDPA path drops `softcap` silently (5.24 refuses SDPA there and picks eager): on the tiny
    Gemma 2 config that reference differs from eager HF, and from tokenmill, by 0.34 nats in
    float32 (the "CUDA" gap of docs/results/gpu-bf16.md; the same on CPU with the soft-cap
    removed). Eager is HF's own reference attention."""
    if path.endswith(".gguf"):
        return None
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    return "eager" if getattr(config, "attn_logit_softcapping", None) else None


def load_hf(path: str, dtype: torch.dtype, device: str = "cpu", attn_implementation: str | None = None):
    """HF transformers' model for a HF directory or a GGUF file, as a plain model in `dtype`
    (attention: `attn_implementation`, default `hf_attention(path)`).

    transformers loads a GGUF with its weights kept quantized and every matmul computing in float32
    whatever dtype was asked for: not HF's bf16 numerics. So a GGUF is loaded in float32 and its
    (dequantized) weights moved into a plain model of the same config, then cast to `dtype`: the
    weights every other run uses, rounded alike."""
    from transformers import AutoModelForCausalLM
    if not path.endswith(".gguf"):
        attn = attn_implementation or hf_attention(path)
        kwargs = {} if attn is None else {"attn_implementation": attn}
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    packed = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32)
    config = packed.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(packed.state_dict())
    return plain.to(device=device, dtype=dtype).eval()


def load_hf_pair(path: str, device: str = "cpu", attn_implementation: str | None = None) -> dict[torch.dtype, object]:
    """HF float32 and bf16 models of one checkpoint (the bf16 one a cast copy: loaded once)."""
    import copy
    hf32 = load_hf(path, torch.float32, device, attn_implementation)
    return {torch.float32: hf32, torch.bfloat16: copy.deepcopy(hf32).to(torch.bfloat16)}


def decision_margin(logits: torch.Tensor, moe, correction_bias: torch.Tensor | None) -> torch.Tensor:
    """float32 [T]: how far each token's expert choice (`routing.select_experts`'s rule) is from a
    tie: the gap between the k-th and (k+1)-th choice score, and, with groups, between the last
    kept and the first dropped group. Softmax scores are compared as logits (log-scores: the gap
    does not shrink with the scores); sigmoid scores (+ correction bias) over their steepest slope.
    So the margin reads in router-logit units, comparable with bf16's error on the logits."""
    logits = logits.float()
    if moe.scoring == "sigmoid":
        # In logit units as well, to first order: a score gap over the steeper of the two
        # boundary experts' sigmoid slopes (groups: twice the token's steepest slope).
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        slope = scores * (1 - scores)
    else:
        choice, slope = logits.log_softmax(dim=-1), None
    margin = torch.full((logits.shape[0],), float("inf"), device=logits.device)
    if moe.num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, moe.num_groups, e // moe.num_groups)
        group_scores = (grouped.topk(2, dim=-1).values.sum(dim=-1) if moe.group_score == "top2_sum"
                        else grouped.max(dim=-1).values)
        top = group_scores.topk(min(moe.topk_groups + 1, moe.num_groups), dim=-1).values
        if top.shape[1] > moe.topk_groups:
            group_gap = top[:, moe.topk_groups - 1] - top[:, moe.topk_groups]
            if slope is not None:  # (a group score sums up to two experts' scores: their steepest slope, twice)
                group_gap = group_gap / (2 * slope.max(dim=-1).values)
            margin = torch.minimum(margin, group_gap)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(moe.topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    top = choice.topk(min(moe.top_k + 1, choice.shape[1]), dim=-1)
    if top.values.shape[1] > moe.top_k:
        gap = top.values[:, moe.top_k - 1] - top.values[:, moe.top_k]
        if slope is not None:
            edge = slope.gather(1, top.indices[:, moe.top_k - 1:moe.top_k + 1]).max(dim=-1).values
            gap = gap / edge
        margin = torch.minimum(margin, torch.nan_to_num(gap, posinf=float("inf")))
    return margin


@torch.inference_mode()
def router_margins(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor | None:
    """float32 [L]: each position's smallest routing `decision_margin` over the model's MoE layers
    (one prefill step of `model`, a float32 tokenmill model); None for a model without routers."""
    from tokenmill.layers.moe.layer import Router
    margins: list[torch.Tensor] = []

    def hook(router: Router, args: tuple) -> None:
        x = args[0]
        logits = torch.nn.functional.linear(x.float(), router.weight.float(),
                                            None if router.bias is None else router.bias.float())
        margins.append(decision_margin(logits, router.moe, router.e_score_correction_bias))

    with hooked(m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Router)) as handles:
        if not handles:
            return None
        tokenmill_logits(model, token_ids, "prefill")
    return torch.stack(margins).min(dim=0).values.cpu()


@torch.inference_mode()
def tokenmill_routes(model: torch.nn.Module, token_ids: Sequence[int],
                     mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`tokenmill_logits`, int64 [L, routers * k]: each position's chosen experts (sorted) in
    every MoE layer as that run chose them; None for a model without routers)."""
    from tokenmill.layers.moe.layer import Router
    routers = [m for m in model.modules() if isinstance(m, Router)]
    calls: dict[int, list[torch.Tensor]] = {id(r): [] for r in routers}
    with hooked(r.register_forward_hook(lambda mod, args, out: calls[id(mod)].append(out[1].sort(dim=-1).values))
                for r in routers):
        logits = tokenmill_logits(model, token_ids, mode)
    if not routers:
        return logits, None
    return logits, torch.cat([torch.cat(calls[id(r)]) for r in routers], dim=-1).cpu()


@torch.inference_mode()
def hf_routes(hf_model, token_ids: Sequence[int], moe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `tokenmill_routes` for a HF model (`hf_logits`, routes): each router module's input
    (`*.mlp.gate` / `*.mlp.router`) taken by a hook, its logits recomputed in float32 from the
    model's own (possibly bf16) input and weights, and chosen by tokenmill's rule
    (`routing.select_experts`, which equals each family's; HF rounds some families' logits to bf16
    first, so a choice within that rounding of a tie may differ from HF's own)."""
    from tokenmill.layers.moe import routing
    gates = [] if moe is None else [
        m for name, m in hf_model.named_modules()
        if name.endswith(("mlp.gate", "mlp.router")) and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2 and m.weight.shape[0] == moe.num_experts]
    chosen: list[torch.Tensor] = []

    def hook(mod, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        bias = getattr(mod, "bias", None)
        logits = torch.nn.functional.linear(x, mod.weight.float(), None if bias is None else bias.float())
        chosen.append(routing.select_experts(logits, moe, getattr(mod, "e_score_correction_bias", None))[1]
                      .sort(dim=-1).values)

    with hooked(g.register_forward_pre_hook(hook) for g in gates):
        logits = hf_logits(hf_model, token_ids)
    return logits, (torch.cat(chosen, dim=-1).cpu() if chosen else None)


def routing_flips(bf16_routes: torch.Tensor | None, f32_routes: torch.Tensor | None) -> torch.Tensor | None:
    """bool [L]: positions whose experts differ between a bf16 run and its float32 run."""
    if bf16_routes is None or f32_routes is None:
        return None
    return (bf16_routes != f32_routes).any(dim=-1)


def measure(label: str, sequences: Sequence[Sequence[int]], tokenmill_models: dict[torch.dtype, torch.nn.Module],
            hf_models: dict[torch.dtype, object], modes: Sequence[str] = MODES,
            tie_margin: float | None = None, max_excluded: float = 0.1) -> DeviationReport:
    """The deviation table for `sequences` (each scored at every position after its first token).

    `tokenmill_models` and `hf_models` map torch.float32 and torch.bfloat16 to models holding the
    same weights. `tie_margin` (MoE models): leave out positions whose float32 routing margin is
    below it (the float32 tokenmill model's routers, which match HF's float32 within
    `float32_gap`) and positions any bf16 run routed otherwise than its float32 run; more than
    `max_excluded` of the positions left out raises ValueError."""
    f32, bf16 = torch.float32, torch.bfloat16
    hf_dev, tm_dev, gap, excluded = [], {m: [] for m in modes}, 0.0, 0
    flips: dict[str, int] = {}
    moe = tokenmill_models[f32].dims.moe if tie_margin is not None else None
    for ids in sequences:
        # Every run once, its routing taken on the way (MoE with tie_margin only).
        (hf32, hf32_r), (hf16, hf16_r) = (hf_routes(hf_models[d], ids, moe) for d in (f32, bf16))
        tm = {(mode, d): tokenmill_routes(tokenmill_models[d], ids, mode) for mode in modes for d in (f32, bf16)}
        keep = None
        margins = None if moe is None else router_margins(tokenmill_models[f32], ids)
        if margins is not None:
            drop = margins < tie_margin
            runs = {"hf": routing_flips(hf16_r, hf32_r)}
            runs.update({f"tokenmill {mode}": routing_flips(tm[mode, bf16][1], tm[mode, f32][1]) for mode in modes})
            for run, flipped in runs.items():
                if flipped is not None:
                    flips[run] = flips.get(run, 0) + int(flipped[:-1].sum())
                    drop |= flipped
            keep = ~drop[:-1]  # position i predicts token i + 1
            excluded += int(drop[:-1].sum())
        pick = (lambda d: d) if keep is None else (lambda d, k=keep: d[k.to(d.device)])
        hf_ref = target_logprobs(hf32, ids)
        hf_dev.append(pick(target_logprobs(hf16, ids) - hf_ref))
        for mode in modes:
            ref = target_logprobs(tm[mode, f32][0].float(), ids)
            gap = max(gap, float((ref - hf_ref).abs().max()))
            tm_dev[mode].append(pick(target_logprobs(tm[mode, bf16][0].float(), ids) - ref))
    tokens = sum(len(s) - 1 for s in sequences)
    if excluded > max_excluded * tokens:
        raise ValueError(f"{label}: {excluded} of {tokens} positions are routing near ties (margin < {tie_margin}) "
                         f"or flips {flips}, "
                         f"more than max_excluded={max_excluded:.0%}: pick other weights or sequences")
    return DeviationReport(label=label, tokens=tokens, float32_gap=gap,
                           hf=Stats.of(torch.cat(hf_dev)),
                           tokenmill={m: Stats.of(torch.cat(d)) for m, d in tm_dev.items()}, excluded=excluded,
                           flips=flips)


def measure_path(path: str, sequences: Sequence[Sequence[int]], label: str | None = None, device: str = "cpu",
                 modes: Sequence[str] = MODES,
                 attn_backend_cls: type[AttentionBackend] = TorchRefAttentionBackend,
                 tie_margin: float | None = None, max_excluded: float = 0.1) -> DeviationReport:
    """`measure` for a checkpoint (HF directory or GGUF file), loading all four models from it."""
    dtypes = (torch.float32, torch.bfloat16)
    tm = {d: load_tokenmill(path, d, device, attn_backend_cls) for d in dtypes}
    hf = load_hf_pair(path, device)
    return measure(label or os.path.basename(path.rstrip("/")), sequences, tm, hf, modes, tie_margin, max_excluded)


def check_not_worse(report: DeviationReport, tolerance: float, tail_tolerance: float | None = None) -> None:
    """Raises AssertionError unless tokenmill's bf16 mean deviation is at most (1 + tolerance) times
    HF's, and its p99 and max at most (1 + tail_tolerance) times (default: tolerance), in every mode."""
    tail = tolerance if tail_tolerance is None else tail_tolerance
    for mode, s in report.tokenmill.items():
        for field, tol in (("mean", tolerance), ("p99", tail), ("max", tail)):
            ours, theirs = getattr(s, field), getattr(report.hf, field)
            if ours > theirs * (1 + tol):
                raise AssertionError(f"{report.label} ({mode}): tokenmill bf16 {field} deviation {ours:.4f} nats "
                                     f"exceeds HF bf16's {theirs:.4f} by more than {tol:.0%}\n"
                                     + format_table([report]))


def format_table(reports: Sequence[DeviationReport]) -> str:
    lines = [f"{'model':<28} {'run':<17} {'tokens':>6} {'mean':>8} {'p99':>8} {'max':>8}   (|logprob - float32|, nats)"]
    for r in reports:
        rows = [("HF bf16", r.hf)] + [(f"tokenmill bf16 {m}", s) for m, s in r.tokenmill.items()]
        for name, s in rows:
            lines.append(f"{r.label:<28} {name:<17} {s.count:>6} {s.mean:>8.4f} {s.p99:>8.4f} {s.max:>8.4f}")
        lines.append(f"{r.label:<28} {'fp32 tm vs HF':<17} {'':>6} {'':>8} {'':>8} {r.float32_gap:>8.1e}"
                     + (f"   ({r.excluded} routing near-tie / flip positions left out; flips {r.flips})"
                        if r.excluded else ""))
    return "\n".join(lines)


def text_sequences(path: str, text: str, num_tokens: int) -> list[list[int]]:
    """One sequence: the first `num_tokens` tokens of `text` under the model's tokenizer."""
    from tokenmill.model.tokenizer import load_tokenizer
    ids = load_tokenizer(path)(text).input_ids
    if len(ids) < num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than num_tokens={num_tokens}")
    return [list(ids[:num_tokens])]


def add_parser(sub) -> None:
    p = sub.add_parser("bf16-deviation", help="teacher-forced bf16 deviation from float32: tokenmill vs HF",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None,
                   help="a HF directory, GGUF file or alias (repeatable; default: the built-in SmolLM2)")
    p.add_argument("--num-tokens", type=int, default=80, help="tokens of the sample text scored per model")
    p.add_argument("--modes", default=",".join(MODES), help="tokenmill runs: prefill, decode or both")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="fail (exit 1) when tokenmill's deviation exceeds HF's by more than this fraction")
    p.add_argument("--output-json", default=None)


def run(ns) -> int:
    from tokenmill.benchmarks.record import machine_info, versions
    from tokenmill.model.default_model import DEFAULT_MODEL, resolve_model_path
    modes = [m for m in ns.modes.split(",") if m]
    reports = []
    for name in ns.model or [DEFAULT_MODEL]:
        path = resolve_model_path(name)
        seqs = text_sequences(path, SAMPLE_TEXT, ns.num_tokens)
        reports.append(measure_path(path, seqs, label=name, device=ns.device, modes=modes))
        print(format_table(reports[-1:]), flush=True)
    failed = [r.label for r in reports if r.worst_ratio() > 1 + ns.tolerance]
    record = {"benchmark": "bf16_deviation", "tolerance": ns.tolerance, "machine": machine_info(),
              "versions": versions(), "reports": [r.as_dict() for r in reports], "failed": failed}
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2)
    print(f"worst tokenmill/HF ratio: {max(r.worst_ratio() for r in reports):.3f}"
          + (f"; worse than HF beyond {ns.tolerance:.0%}: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
