"""The parallelism flags have vLLM's names (with -tp / -pp) and bad values fail at resolution,
naming the field, before any process starts."""

from __future__ import annotations

import pytest

from tokenmill.cli import build_parser
from tokenmill.config import EngineArgs, engine_args_from_flags
from tokenmill.frontend.engine_config import resolve_engine_config


def test_flags_reach_the_config(tiny_model) -> None:
    ns = build_parser().parse_args(["generate", "--prompt", "x", "-tp", "2", "-pp", "2", "--pp-layer-partition",
                                    "2,1", "--distributed-executor-backend", "ray"])
    args = engine_args_from_flags(ns, tiny_model)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    parallel = resolve_engine_config(args).parallel
    assert parallel.layer_partition == (2, 1) and parallel.backend == "ray"
    assert parallel.world_size == 4 and parallel.driver_rank == 2  # TP rank 0 of the last stage
    assert parallel.split_attention == ()
    ns = build_parser().parse_args(["generate", "--prompt", "x", "-pp", "2", "--pp-layer-partition", "1.5,1.5"])
    parallel = resolve_engine_config(engine_args_from_flags(ns, tiny_model)).parallel
    assert parallel.layer_partition == (1, 2) and parallel.split_attention == (True,)


@pytest.mark.parametrize("kwargs,field", [
    (dict(tensor_parallel_size=2, single_process=True), "tensor_parallel_size"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, load_format="null"), "pipeline_parallel_size"),
    (dict(distributed_executor_backend="mpi"), "distributed_executor_backend"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="3,3"), "pp_layer_partition"),
    (dict(pipeline_parallel_size=4), "pipeline_parallel_size"),  # 3 layers
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads
    (dict(pipeline_parallel_size=2, pp_layer_partition="2.5,0.5"), "pp_layer_partition"),  # no attention on stage 1
    (dict(pipeline_parallel_size=2, pp_layer_partition="1.5,1.5", enable_lora=True), "pp_layer_partition"),
])
def test_bad_parallel_args_name_the_field(tiny_model, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        resolve_engine_config(EngineArgs(model=tiny_model, **kwargs))
