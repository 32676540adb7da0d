"""Batched multi-LoRA: every row of a step may use another adapter (or none), in one pass.

Per LoRA-enabled projection (`lora_layer.LoRASlots`), the adapters sit in stacked device buffers
of fixed shape, one entry per slot: A [slots, parts * R, in] and B [slots, out, R], R the
padded max rank, the scaling folded into B. A fused projection (qkv, gate_up) has one part per
HF projection: output columns of part i read the shrink's columns [i * R, (i + 1) * R).

`y += (x @ A[s]^T) @ B[s]^T` per token, s the token's slot (-1: nothing added):
- Triton (CUDA): shrink and expand, per token at decode sizes and over tiles of tokens of one
  slot (sorted on the device) beyond, adding into y in place, planned once per step,
  capture-safe (no host syncs): `triton_lora.py` the step's plan and launch shapes (and every
  tunable), `triton_shrink.py`, `triton_expand.py`, `triton_fused.py` (the decode path's fusions:
  gate_up's expand with SiLU-and-mul, the next projection's shrink), `triton_concat.py` (a step of
  one slot: its LoRA inside the base GEMM, as extra K columns of a wider weight);
- `torch_lora.py`: the reference (gathered per token) and the CPU path (a matmul per slot).
"""
