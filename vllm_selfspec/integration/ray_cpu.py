"""vLLM's Ray executor on the CPU platform, one node (`SELFSPEC_RAY_CPU=1`).

vLLM 0.32's CPU platform has no Ray device key, so `RayExecutorV2` refuses it
("current platform cpu does not support ray"). With the switch on, the plugin
gives the CPU platform the key "CPU" (placement-group bundles of one CPU per
rank), asks Ray for no GPU per actor, and ships actors a worker class that
reports its rank as its device instead of asking Ray for accelerator ids
(Ray lists none for CPUs). Everything else (gloo, the shared-memory all-reduce,
message queues, our plugin in each actor) is vLLM's own Ray path. It exists so
the CPU machines here can run the Ray path the GPU users run; GPU platforms
never take it. The three vLLM symbols are listed in `patches.RAY_CPU_PATCHES`.
"""

from __future__ import annotations

from vllm.v1.executor import ray_executor_v2

RAY_DEVICE_KEY = "CPU"


def actor_resources() -> dict:
    """Ray forbids "CPU" under `resources`; the bundle already holds the CPU."""
    return {"num_gpus": 0}


class CpuRayWorkerProc(ray_executor_v2.RayWorkerProc):
    """vLLM's Ray worker, with its rank as its device id: Ray shares CPUs
    between actors and names no accelerator ids for them. Ray pickles this
    class by reference, so actors import it from this package."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        import ray

        return ray.get_runtime_context().get_node_id(), [self._init_kwargs["rank"]]
