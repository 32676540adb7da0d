#!/bin/bash
# Issue 22, INT4 W4A16 batch 1 (Llama-3.1-8B shape, dummy weights, GPTQ group 128, graphs on), session 9's
# final round: in ONE process on one card, bf16 and INT4 with the folded norms off and on (two engines
# each, alternating: instances of one engine differ by up to ~100 us a token).
#   OUT=<dir> bash scripts/gpu_int4_b1_final.sh        # ~135 s on an H100; figures in $OUT
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
t0=$(date +%s)
timeout 14 python scripts/int4_table_precompile.py 12 2>&1 | tail -2
timeout 24 python scripts/int4_fold_precompile.py 22 2>&1 | grep -v "^ *File\|^    " | tail -3
echo "precompiled at $(( $(date +%s) - t0 )) s"
INT4_B1_SKIP_KERNELS=1 INT4_B1_BUDGET_S=95 INT4_B1_PROFILE=none \
  INT4_B1_ENGINES=bf16,int4nofold,int4scale,int4nofold2,int4scale2 \
  timeout 122 python scripts/gpu_quant.py --parts int4b1 --budget 120 > "$OUT/int4b1.log" 2>&1
echo "gpu_quant rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "self-tests|batch1:|/ bf16|mean of|engine up|Traceback|Error" "$OUT/int4b1.log" | head -40
