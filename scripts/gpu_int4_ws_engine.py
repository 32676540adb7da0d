"""Whether an INT4 engine really takes the warp-specialized GEMM's route (`int4_ws_route`), and its
256x256x128 throughput: the dummy-weight Llama-8B GPTQ engine of scripts/gpu_quant.py, built with
TOKENMILL_INT4_WS_TABLE as set in the environment, every `int4_ws_route.run` call counted by shape
(the engine's start-up self-test, warm-up and CUDA-graph captures call it; a replay does not come back
to Python; the engine in this process, `single_process=True`), then 256x256x128 timed REPEATS times.

    TOKENMILL_INT4_WS_TABLE="256,4096,4096=ws_m128_n64_st6_w4_d4_r136_p0_km2" \\
        python scripts/gpu_int4_ws_engine.py OUT [REPEATS]

Writes OUT/int4ws-engine.json: the table, whether the route is on after the start-up self-test
(`ENABLED`), the calls by (rows, N, K), tok/s per run.
"""

from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_dir: str, repeats: int) -> None:
    import gpu_quant  # scripts/

    from tokenmill.layers.quantization import int4_ws_route as ws

    calls: collections.Counter = collections.Counter()
    real = ws.run

    def counted(x, qm, *args, **kwargs):
        calls[f"{x.shape[0]},{qm.shape[0] * 16},{qm.shape[1] * 64}"] += 1
        return real(x, qm, *args, **kwargs)

    ws.run = counted  # `mma_matmul` looks it up at each call
    # single_process: the engine core and its worker in this process, where the counter is (by default they
    # run in a child process, which reads the table from the environment it inherits but never calls `counted`)
    llm, up_s = gpu_quant._engine(gpu_quant.config_dir(gpu_quant.LLAMA8B, gpu_quant.GPTQ_CONFIG), 256 + 128 + 16,
                                  enable_prefix_caching=False, single_process=True)
    rec = {"table": {f"{k}": t.label() for k, t in ws.TABLE.items()}, "enabled": ws.ENABLED, "engine_up_s": up_s,
           "calls_at_start": dict(calls)}
    runs = [gpu_quant.throughput(llm, 256, 256, 128) for _ in range(repeats)]
    rec.update(calls=dict(calls), tok_s=runs, tok_s_median=sorted(runs)[len(runs) // 2])
    print(json.dumps(rec, indent=1), flush=True)
    with open(os.path.join(out_dir, "int4ws-engine.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
