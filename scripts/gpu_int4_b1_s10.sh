#!/bin/bash
# Issue 22, INT4 W4A16 batch 1, session 10 (Llama-3.1-8B shape, dummy weights, GPTQ group 128, graphs on):
# decode attention's PREWAIT (reads before the PDL wait) and ROPE (the rotary + KV write inside it).
# 1. precompiles (background) beside `gpu_attn_prewait.py --checks` (the default against main's path, bit
#    for bit caches; a graph behind a slow PDL writer; a planted no-wait launch must fail), then
#    `--timing`: us per layer of norm + INT4 qkv GEMV + attention step, main / PREWAIT / + ROPE / ...;
# 2. engines in ONE process on one card: bf16 and INT4 with the new defaults (int4new), INT4 on main's
#    attention path (int4off), then, budget allowing, PREWAIT alone (int4pw) and bf16 on main's path.
#   OUT=<dir> bash scripts/gpu_int4_b1_s10.sh [ENGINES] [ENGINE_BUDGET_S]      # ~150-170 s on an H100
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
ENGINES=${1:-bf16,int4new,int4off,int4pw,bf16off}
BUDGET=${2:-50}
t0=$(date +%s)
( timeout 14 python scripts/int4_table_precompile.py 12 > "$OUT/precompile.log" 2>&1
  timeout 24 python scripts/int4_fold_precompile.py 22 >> "$OUT/precompile.log" 2>&1 ) &
pre=$!
timeout 50 python scripts/gpu_attn_prewait.py "$OUT" --checks > "$OUT/attn_checks.log" 2>&1
echo "attn checks rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "ok  |FAIL|done at|Error|error" "$OUT/attn_checks.log" | head -24
wait $pre
tail -3 "$OUT/precompile.log" | grep -v "^ *File"
echo "precompiled at $(( $(date +%s) - t0 )) s"
if [ "${ATTN_TIMING:-1}" = 1 ]; then  # (ATTN_TIMING=0: engines only after the checks)
  timeout 45 python scripts/gpu_attn_prewait.py "$OUT" --timing > "$OUT/attn_timing.log" 2>&1
  echo "attn timing rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "us a layer|Error|error" "$OUT/attn_timing.log" | head -10
fi
INT4_B1_SKIP_KERNELS=1 INT4_B1_BUDGET_S=$BUDGET INT4_B1_PROFILE=int4new INT4_B1_ENGINES=$ENGINES \
  timeout $(( BUDGET + 45 )) python scripts/gpu_quant.py --parts int4b1 --budget $(( BUDGET + 40 )) > "$OUT/int4b1.log" 2>&1
echo "gpu_quant rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "self-tests|batch1:|/ bf16|engine up|greedy|Traceback|Error" "$OUT/int4b1.log" | head -30
