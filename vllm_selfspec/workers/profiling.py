"""Worker-side tools for benchmarks and the skip-set search.

Engines started with `worker_extension_cls=WORKER_EXTENSION` get these as
worker methods, called with `LLM.collective_rpc("selfspec_...")`.

`selfspec_set_skip_set` and `selfspec_set_option` change the running drafter
(the skip-set search, threshold sweeps); `selfspec_trace` and
`selfspec_counters` read what it did (DEL's choices, layers run).

`selfspec_step_costs` times one draft step against one plain decode step. Both
models get the same one-token-per-request batch under a forward context without
attention metadata (vLLM's profiling mode), so both run every projection, MLP,
norm and the LM head, and both skip only the attention kernel itself, which at
the short contexts of a decode step is a small share of the time.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _time_forward(model, vllm_config, batch_size: int, repeats: int) -> float:
    from vllm.forward_context import set_forward_context

    input_ids = torch.zeros(batch_size, dtype=torch.int32)
    positions = torch.zeros(batch_size, dtype=torch.int64)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "positions": positions}
    timings = []
    for _ in range(repeats + 2):  # two warm-up calls
        start = time.perf_counter()
        with set_forward_context(None, vllm_config, num_tokens=batch_size):
            hidden = model(**kwargs)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            model.compute_logits(hidden)
        timings.append(time.perf_counter() - start)
    timings = sorted(timings[2:])
    return timings[len(timings) // 2]


WORKER_EXTENSION = "vllm_selfspec.workers.profiling.SelfSpecWorkerExtension"


class SelfSpecWorkerExtension:
    """Mixed into vLLM's worker class by `worker_extension_cls`."""

    def selfspec_step_costs(self, batch_size: int = 1, repeats: int = 30) -> dict:
        return measure_step_costs(self, batch_size, repeats)

    def selfspec_set_skip_set(self, attn_skip: list[int], mlp_skip: list[int]) -> str:
        return set_skip_set(self, attn_skip, mlp_skip)

    def selfspec_set_option(self, name: str, value) -> None:
        """Change a method option the drafter reads every round (e.g. AdaDecode's
        threshold), for sweeps in one engine."""
        options = self.model_runner.drafter.options
        if name not in options.own_fields:
            raise ValueError(f"{name} is not an option of {options.method}")
        setattr(options, name, value)

    def selfspec_trace(self, start: bool = False) -> dict | None:
        """The drafter's per-round choices per request (DEL); `start` clears
        the record and starts recording."""
        drafter = self.model_runner.drafter
        if start:
            drafter.trace = {}
            return None
        return drafter.trace

    def selfspec_counters(self) -> dict:
        """Rounds (target forwards), draft steps and draft layers run so far."""
        return vars(self.model_runner.drafter.counters).copy()


def measure_step_costs(worker, batch_size: int = 1, repeats: int = 30) -> dict:
    """Median seconds of a plain step and a draft step, and their ratio."""
    runner = worker.model_runner
    drafter = runner.drafter
    plain = _time_forward(runner.model, runner.vllm_config, batch_size, repeats)
    draft = _time_forward(drafter.model, drafter.vllm_config, batch_size, repeats)
    plan = drafter.model.plan
    return {
        "plain_step_s": plain,
        "draft_step_s": draft,
        "cost_ratio": draft / plain,
        "fraction_of_sublayers_run": plan.fraction_run,
        "plan": plan.describe(),
    }


def set_skip_set(worker, attn_skip: list[int], mlp_skip: list[int]) -> str:
    """Make the drafter skip these sub-blocks (used by the skip-set search)."""
    from vllm_selfspec.workers.draft_model import LayerPlan

    drafter = worker.model_runner.drafter
    plan = LayerPlan.skipping(drafter.model.plan.num_layers, attn_skip, mlp_skip)
    drafter.replace_layer_plan(plan)
    return plan.describe()
