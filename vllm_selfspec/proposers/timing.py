"""Timing forwards at start-up: the costs cost-aware drafting starts from
(the target's forward by the tokens in it, a draft step by the requests in
it, DEL's exits), in vLLM's profiling mode (a forward context without
attention metadata, so every projection, MLP, norm and LM head runs and only
the attention kernel itself is left out), and the warm-up forwards that make
first calls at a shape happen at start-up rather than in a user's request."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from vllm_selfspec.policy.payoff import ForwardTimes, timing_grid


def in_profiling_mode(step: Callable[[], Any], vllm_config,
                       batch_size: int) -> Callable[[], None]:
    """`step` under a forward context without attention metadata."""
    from vllm.forward_context import set_forward_context

    def run() -> None:
        with set_forward_context(None, vllm_config, num_tokens=batch_size):
            step()

    return run


def median_seconds(step: Callable[[], Any], vllm_config, batch_size: int,
                    repeats: int) -> float:
    """Median time of `step` (after two warm-up calls) in profiling mode."""
    run = in_profiling_mode(step, vllm_config, batch_size)
    timings = []
    for _ in range(repeats + 2):
        _synchronize()
        start = time.perf_counter()
        run()
        _synchronize()
        timings.append(time.perf_counter() - start)
    timings = sorted(timings[2:])
    return timings[len(timings) // 2]


def _synchronize() -> None:
    """Wait for the device (a GPU runs kernels asynchronously)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def decode_inputs(batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of a one-token-per-request decode step on
    `device`, for the timing forwards (their values do not change the time)."""
    return (torch.zeros(batch_size, dtype=torch.int32, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device))


def forward_step(model, batch_size: int) -> Callable[[], None]:
    """One decode forward of `model` and its LM head for `batch_size` tokens."""
    input_ids, positions = decode_inputs(batch_size, next(model.parameters()).device)

    def step() -> None:
        hidden = model(input_ids=input_ids, positions=positions)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        model.compute_logits(hidden)

    return step


def warm_up(model, vllm_config, num_tokens: int) -> None:
    """One forward and LM head of `model` over `num_tokens` tokens, in
    profiling mode and in inference mode as serving runs, so that what a
    module's first call at a shape costs is paid now and not inside a user's
    request: vLLM's `torch.compile`d activation inside uncompiled layers
    (traced at first call; its guards include the grad mode) and oneDNN's
    primitives for the shape."""
    with torch.inference_mode():
        in_profiling_mode(forward_step(model, num_tokens), vllm_config, num_tokens)()


def time_forward(model, vllm_config, batch_size: int, repeats: int) -> float:
    return median_seconds(forward_step(model, batch_size), vllm_config, batch_size, repeats)


def draft_step_seconds(vllm_config, draft, repeats: int = 10) -> float:
    """One decode step of `draft` at batch 1 with its LM head, in profiling
    mode (which also compiles it at start-up, not in a user's request)."""
    return time_forward(draft, vllm_config, 1, repeats)


def measure_exit_costs(runner, batch_size: int = 1, repeats: int = 30) -> dict:
    """Early-exit drafts: seconds of a draft step exiting at each exit layer E
    (segments up to E and the LM head). A line through them, T(E) = t*(E + o),
    gives a layer's time t and a step's fixed cost o in layers: DEL's
    `step_overhead`."""
    model = runner.drafter.model
    input_ids, positions = decode_inputs(batch_size, runner.device)

    def exit_step(depth: int) -> None:
        hidden_states = residual = head_input = None
        for segment in model.segments[:depth]:
            hidden_states, residual, head_input = segment(
                input_ids, positions, hidden_states, residual)
        model.compute_logits(head_input)

    seconds = {segment.end: median_seconds(lambda d=depth: exit_step(d), runner.vllm_config,
                                            batch_size, repeats)
               for depth, segment in enumerate(model.segments, start=1)}
    plain = time_forward(runner.model, runner.vllm_config, batch_size, repeats)
    exits = np.array(list(seconds), dtype=float)
    times = np.array(list(seconds.values()))
    num_layers = model.plan.num_layers
    if len(exits) > 1:
        layer_s, fixed_s = np.polyfit(exits, times, 1)
    elif exits[0] < num_layers:  # one exit: the plain step's layers give the second point
        layer_s = (plain - times[0]) / (num_layers - exits[0])
        fixed_s = times[0] - layer_s * exits[0]
    else:  # one exit after the last layer: a single point, no line
        layer_s, fixed_s = times[0] / num_layers, float("nan")
    return {"exit_step_s": seconds, "plain_step_s": plain, "layer_s": float(layer_s),
            "step_overhead_layers": float(fixed_s / layer_s)}


def time_forwards(runner, drafter, max_drafts: int) -> ForwardTimes:
    """The target's forward at 1, 2, 4, ... tokens up to what a full batch
    verifies (capped at the step's token budget and MAX_TIMED_TOKENS), and a
    draft step at 1, 2, 4, ... requests up to the scheduler's batch (capped at
    MAX_TIMED_BATCH): the stand-in costs of every batch size."""
    scheduler = runner.vllm_config.scheduler_config
    most_tokens = min(scheduler.max_num_batched_tokens, MAX_TIMED_TOKENS,
                      scheduler.max_num_seqs * (1 + max_drafts))
    tokens = timing_grid(most_tokens)
    batch_sizes = timing_grid(min(scheduler.max_num_seqs, MAX_TIMED_BATCH))
    # Where a mechanism is weighed against the full-depth base, the base's step
    # (the gate reads the mechanism's through its timed share).
    draft = drafter.model if drafter.base_draft is None else drafter.base_draft
    return ForwardTimes(
        tokens, tuple(time_forward(runner.model, runner.vllm_config, n, _repeats(n))
                      for n in tokens),
        batch_sizes, tuple(time_forward(draft, drafter.vllm_config, b, _repeats(b))
                           for b in batch_sizes))


# The timing grid's ends: past them the times are extended along the last
# segment (a compute-bound forward grows linearly in its tokens).
MAX_TIMED_TOKENS = 256
MAX_TIMED_BATCH = 64


def _repeats(num_tokens: int) -> int:
    """Fewer timing repeats for larger forwards (their noise is smaller)."""
    return 10 if num_tokens <= 4 else 5 if num_tokens <= 16 else 3
