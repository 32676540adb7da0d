"""Workers as Ray actors, for a model split across several nodes (`--distributed-executor-backend ray`).

One placement group holds one bundle per rank (a GPU each on CUDA, a CPU each otherwise), packed
node by node, so consecutive ranks (a TP group) share a node where they fit. Actor i is rank i
in bundle i. They meet for torch.distributed at a TCP store on rank 0's node (gloo or NCCL,
across nodes). Each step is encoded once with msgspec and the same bytes go to every actor
(`RayWorker.execute`); the future resolves to the driver's decoded `ModelRunnerOutput`, and
fails if any rank's call fails. A step that waits for its grammar masks (structured outputs) is
answered by the ranks' `finish` calls, which carry the masks (`send_bitmask`). Ray is optional: `pip install tokenmill[ray]`. The engine
joins the cluster named by RAY_ADDRESS, or starts a local one.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future

import msgspec

from tokenmill.child_process import package_root
from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.executor.ray_worker import RayWorker
from tokenmill.metrics.message_stats import MessageStats
from tokenmill.protocol import (GrammarBitmask, ModelRunnerOutput, ProcessTelemetry, SchedulerOutput, WorkerCall,
                                WorkerCallResult)

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend ray needs Ray: pip install 'tokenmill[ray]'") from None
    return ray


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True,
                     runtime_env={"env_vars": {"PYTHONPATH": package_root()}})  # this very tokenmill
        world = config.parallel.world_size
        self.driver_rank = config.parallel.driver_rank
        bundle = {"GPU": 1, "CPU": 1} if config.device.startswith("cuda") else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        self._remove_pg = remove_placement_group
        self.actors = []
        self.channels = {name: MessageStats() for name in ("steps", "results", "worker_calls",
                                                            "worker_call_results", "masks")}
        self._step_encoder = msgspec.msgpack.Encoder()
        self._awaiting_masks: deque[Future] = deque()  # steps answered by `finish` (in step order)
        self._step_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._result_decoder = msgspec.msgpack.Decoder(WorkerCallResult)
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"Ray could not place {world} workers ({bundle} each) within "
                                   f"{_PLACEMENT_TIMEOUT_S:g} s; the cluster has {ray.cluster_resources()}")
            actor_cls = ray.remote(RayWorker)
            config_json = msgspec.json.encode(config)
            level = logging.getLogger("tokenmill").getEffectiveLevel()
            for rank in range(world):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                            placement_group_bundle_index=rank)
                self.actors.append(actor_cls.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy).remote(config_json, rank, level))
            self.nodes = ray.get([actor.node.remote() for actor in self.actors])
            master_ip = self.nodes[0][1]
            port = ray.get(self.actors[0].free_port.remote())
            init_method = f"tcp://{master_ip}:{port}" if world > 1 else ""
            ray.get([actor.start.remote(init_method) for actor in self.actors])
            logger.info("Ray workers on nodes %s", [node for node, _ in self.nodes])
            self.call("load_model")
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, arg: int | None = None) -> list:
        message = msgspec.msgpack.encode(WorkerCall(method, arg))
        self.channels["worker_calls"].encoded(len(message), 0.0)
        replies = self._ray.get([actor.call.remote(message) for actor in self.actors])
        return [self._result_decoder.decode(reply).value for reply in replies]

    def available_kv_blocks(self) -> int:
        return min(self.call("available_kv_blocks"))

    def kv_block_bytes(self) -> int:
        return self.call("kv_block_bytes")[self.driver_rank]

    def init_kv_cache(self, num_blocks: int) -> None:
        self.call("init_kv_cache", num_blocks)

    def weight_bytes(self) -> int:
        return sum(self.call("weight_bytes"))

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        start = time.perf_counter()
        message = self._step_encoder.encode(scheduler_output)
        self.channels["steps"].encoded(len(message), time.perf_counter() - start)
        refs = [actor.execute.remote(message) for actor in self.actors]
        future: Future[ModelRunnerOutput] = Future()
        awaits = scheduler_output.awaits_bitmask  # then only a failure settles it here
        if awaits:
            self._awaiting_masks.append(future)
        for rank, ref in enumerate(refs):
            ref.future().add_done_callback(lambda done, rank=rank: self._settle(future, rank, done, awaits))
        return future

    def send_bitmask(self, mask: GrammarBitmask) -> None:
        """The masks of the oldest step waiting for them: every rank's `finish` samples it."""
        start = time.perf_counter()
        message = self._step_encoder.encode(mask)
        self.channels["masks"].encoded(len(message), time.perf_counter() - start)
        future = self._awaiting_masks.popleft()
        refs = [actor.finish.remote(message) for actor in self.actors]
        for rank, ref in enumerate(refs):
            ref.future().add_done_callback(lambda done, rank=rank: self._settle(future, rank, done))

    def _settle(self, future: Future, rank: int, done: Future, failure_only: bool = False) -> None:
        """The step's future: the driver's output, or the first rank's failure."""
        if future.done():
            return
        exc = done.exception()
        if exc is not None:
            future.set_exception(exc)
        elif rank == self.driver_rank and not failure_only:
            payload = done.result()
            start = time.perf_counter()
            output = self._step_decoder.decode(payload)
            self.channels["results"].decoded(len(payload), time.perf_counter() - start)
            future.set_result(output)

    def channel_stats(self) -> dict[str, MessageStats]:
        return self.channels

    def worker_telemetry(self) -> list[ProcessTelemetry]:
        return self.call("telemetry_snapshot")

    def reset_worker_telemetry(self) -> None:
        self.call("reset_telemetry")

    def held_requests(self) -> list[int]:
        return self.call("held_requests")

    def shutdown(self) -> None:
        ray = self._ray
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor: nothing to stop
                pass
            ray.kill(actor)
        self.actors = []
        try:
            self._remove_pg(self._pg)
        except Exception:  # noqa: BLE001 - the cluster is gone already
            pass
