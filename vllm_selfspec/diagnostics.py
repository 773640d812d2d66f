"""Worker-side tools for benchmarks and the skip-set search.

Engines started with `worker_extension_cls=WORKER_EXTENSION` get these as
worker methods, called with `LLM.collective_rpc("selfspec_...")`.

`selfspec_set_skip_set` and `selfspec_set_option` change the running drafter
(the skip-set search, threshold sweeps); `selfspec_trace` and
`selfspec_counters` read what it did (DEL's choices, layers run);
`selfspec_state` how much per-request state it holds (the load test's leak
check, over `vllm serve`'s dev-mode /collective_rpc).

`selfspec_exit_costs` times early-exit draft steps at each exit layer.
`selfspec_step_costs` times one draft step against one plain decode step
(`selfspec_profile_forwards` breaks both down by operator), both in vLLM's
profiling mode as the start-up timings are (`proposers/timing.py`).
`selfspec_draft_output_rows` checks that every compiled draft runs any
number of tokens. `selfspec_round_costs` returns what the engine itself timed: whole rounds,
plain and drafted, everything a user waits for included.
`selfspec_time_step_pieces` times the runner's parts of each step while
serving (the forward, sampling, drafting and each draft step, bookkeeping),
and `selfspec_profile_steps` breaks those steps down by operator, for
`scripts/profile_step.py`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from vllm_selfspec.policy.payoff import StepCosts
from vllm_selfspec.proposers.timing import (
    decode_inputs,
    forward_step,
    in_profiling_mode,
    measure_exit_costs,
    time_forward,
)


def profile_forwards(worker, batch_size: int = 1, steps: int = 5, top: int = 20) -> dict:
    """Where a plain and a draft forward spend their time: each forward's
    operators by self time (torch profiler, profiling mode as above), in
    milliseconds per step, with each one's share of the step."""
    from torch.profiler import ProfilerActivity, profile

    runner = worker.model_runner
    report = {}
    for name, model in (("plain", runner.model), ("draft", runner.drafter.model)):
        run = in_profiling_mode(forward_step(model, batch_size), runner.vllm_config,
                                 batch_size)
        for _ in range(3):  # warm-up
            run()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(steps):
                run()
        events = operators_by_self_time(profiler)
        total = sum(e.self_cpu_time_total for e in events)
        report[name] = {"ms_per_step": total / steps / 1e3, "operators": [
            {"name": e.key, "ms_per_step": e.self_cpu_time_total / steps / 1e3,
             "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps}
            for e in events[:top]]}
    return report


def operators_by_self_time(profiler) -> list:
    """A finished torch profile's operators that took self time, most first."""
    events = [e for e in profiler.key_averages() if e.self_cpu_time_total > 0]
    return sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)


WORKER_EXTENSION = "vllm_selfspec.diagnostics.SelfSpecWorkerExtension"


class SelfSpecWorkerExtension:
    """Mixed into vLLM's worker class by `worker_extension_cls`."""

    def selfspec_step_costs(self, batch_size: int = 1, repeats: int = 30,
                            uncompiled: bool = False) -> dict:
        return measure_step_costs(self, batch_size, repeats, uncompiled)

    def selfspec_profile_forwards(self, batch_size: int = 1) -> dict:
        return profile_forwards(self, batch_size)

    def selfspec_exit_costs(self, batch_size: int = 1, repeats: int = 30) -> dict:
        return measure_exit_costs(self.model_runner, batch_size, repeats)

    def selfspec_set_skip_set(self, attn_skip: list[int], mlp_skip: list[int]) -> str:
        return set_skip_set(self, attn_skip, mlp_skip)

    def selfspec_set_option(self, name: str, value) -> None:
        """Change a method option the drafter reads every round (e.g. AdaDecode's
        threshold), for sweeps in one engine; the value is type-checked and the
        method's own checks run, else nothing changes."""
        set_option(self.model_runner.drafter.options, name, value)

    def selfspec_trace(self, start: bool = False) -> dict | None:
        """The drafter's per-round choices per request (DEL); `start` clears
        the record and starts recording."""
        drafter = self.model_runner.drafter
        if start:
            drafter.trace = {}
            return None
        return drafter.trace

    def selfspec_search(self) -> dict:
        """SWIFT: each task's skip-set search, the set drafting now, and the
        seconds spent optimising."""
        return self.model_runner.drafter.search_report()

    def selfspec_exit_gate(self) -> dict | None:
        """AdaDecode over its full-depth base: each head's measured acceptance,
        the base's where each head was sure and overall (`policy/exit_gate.py`),
        and the heads open in the last drafting round (None: every head)."""
        drafter = self.model_runner.drafter
        gate = getattr(drafter, "exit_gate", None)
        last = drafter.gate_round
        return None if gate is None else {**gate.describe(),
                                          "open": None if last is None else last.open}

    def selfspec_mechanism_gate(self) -> dict | None:
        """A method with a mechanism over its full-depth base: each source's
        measured acceptance and round length, the mechanism's share of draft
        steps, its trials and the rounds it declined, and its step's cost over
        the base's (`policy/mechanism_gate.py`); None without one."""
        drafter = self.model_runner.drafter
        sources = drafter.sources
        return None if sources is None else {**sources.describe(),
                                             "step_cost_share": drafter.mechanism_step_share}

    def selfspec_state(self) -> dict:
        """Per-request state the drafter holds, and this worker's resident
        memory: what must stay bounded under load."""
        import psutil

        drafter = getattr(self.model_runner, "drafter", None)  # none without speculation
        return {"requests_with_state": drafter.per_request_state() if hasattr(
                    drafter, "per_request_state") else {},
                "rss_mb": psutil.Process().memory_info().rss / 2**20,
                "ray_actor": _ray_actor_id()}

    def selfspec_draft_weights(self) -> dict:
        """What the draft reads: its precision, the copy's bytes on this rank
        beside the model's, how many tokens its head keeps (None: all), how
        many of the target's layers any draft runs through, and how many of
        those attend through one op (`draft/attention.py`)."""
        from vllm_selfspec.draft.attention import DraftAttention

        drafter = self.model_runner.drafter
        weights = drafter.draft_weights
        vocab = drafter.options.draft_vocab_token_ids()
        return {"precision": weights.precision, "extra_bytes": weights.extra_bytes,
                "model_bytes": weights.model_bytes,
                "vocab_tokens": None if vocab is None else len(vocab),
                "draft_depth": drafter.draft_depth(len(weights.layers)),
                "one_op_attention_layers": sum(isinstance(m, DraftAttention)
                                               for m in weights.layers.modules())}

    def selfspec_round_costs(self) -> dict:
        """The engine's timed rounds (plain, drafted and looked-up, seconds,
        per batch size), what is timed at start-up where it can be (the
        forward times behind the stand-in costs; DEL's step overhead) and the costs the budget
        uses now, and the goodput gates' measured ratios per batch bucket
        (self-drafting and lookup-only rounds' throughput over plain's) with
        the closed ones (`RoundPolicy.goodput`)."""
        drafter = self.model_runner.drafter
        policy = drafter.policy
        return {**policy.timings(), **drafter.timed_at_start_up()}

    def selfspec_pin_costs(self, costs: dict | None) -> None:
        """Cost-aware drafting decides every round at these costs
        (`StepCosts`' fields, in plain steps) instead of the engine's timings
        and goodput gates, so it chooses alike on any CPU; None: timed again
        (`RoundPolicy.pin_costs`)."""
        self.model_runner.drafter.policy.pin_costs(
            None if costs is None else StepCosts(**costs))

    def selfspec_time_step_pieces(self, start: bool = False) -> dict | None:
        """Calls and seconds of each timed piece of the runner's steps since
        `start` (which clears the record and starts timing)."""
        return time_step_pieces(self.model_runner, start)

    def selfspec_profile_steps(self, start: bool = False) -> dict | None:
        """Operators by self time over the steps since `start` (which starts
        the profiler): `profile_decode_steps`."""
        return profile_decode_steps(self.model_runner, start)

    def selfspec_counters(self) -> dict:
        """Rounds (target forwards), draft steps and draft layers run so far."""
        return self.model_runner.drafter.policy.work_done()

    def selfspec_draft_output_rows(self, num_tokens: int) -> dict[str, int]:
        """How many rows each of the drafter's drafts (the drafting one, and the
        full-depth base where it has one) returns for `num_tokens` tokens, in
        profiling mode: a compiled graph specialised to another count returns
        that count's."""
        drafter = self.model_runner.drafter
        drafts = {"drafting": drafter.model, "base": drafter.base_draft}
        input_ids, positions = decode_inputs(num_tokens, drafter.device)
        rows = {}
        with torch.inference_mode():
            for name, draft in drafts.items():
                if draft is not None:
                    hidden = []
                    in_profiling_mode(lambda d=draft: hidden.append(
                        d(input_ids=input_ids, positions=positions)),
                        self.model_runner.vllm_config,
                        num_tokens)()
                    output = hidden[0][0] if isinstance(hidden[0], tuple) else hidden[0]
                    rows[name] = int(output.shape[0])
        return rows


def _ray_actor_id() -> str | None:
    """The Ray actor this worker runs in (Ray executor), else None."""
    try:
        import ray
    except ImportError:
        return None
    return ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None


# The runner's step, in the order it runs: the forward (inputs included),
# then sampling, the drafter and output bookkeeping.
RUNNER_PIECES = ("execute_model", "_prepare_inputs", "sample_tokens", "_sample",
                 "propose_draft_token_ids", "_bookkeeping_sync")
# Ours has all (one draft step: `draft_step`, a full-depth base's `base_step`);
# vLLM's only propose.
DRAFTER_PIECES = ("decline_early", "propose", "draft_step", "base_step")


def time_step_pieces(runner, start: bool) -> dict | None:
    """Time the runner's step pieces from now on (`start`, which also clears
    the record), or return {piece: [calls, seconds]} so far."""
    timer = getattr(runner, "selfspec_step_timer", None)
    if timer is None:
        timer = runner.selfspec_step_timer = StepPieceTimer(runner)
    if start:
        timer.record.clear()
        return None
    return {label: list(value) for label, value in timer.record.items()}


def profile_decode_steps(runner, start: bool, top: int = 30) -> dict | None:
    """Operators by self time over the engine's own steps since `start`
    (torch profiler, CPU), where `profile_forwards` times forwards in
    profiling mode: here attention runs over real metadata and the drafter's
    loop runs as it does while serving. Returns the `top` operators, each
    with its calls and self milliseconds, and the total self milliseconds."""
    from torch.profiler import ProfilerActivity, profile

    profiler = getattr(runner, "selfspec_step_profiler", None)
    if start:
        if profiler is not None:
            profiler.stop()
        runner.selfspec_step_profiler = profile(activities=[ProfilerActivity.CPU])
        runner.selfspec_step_profiler.start()
        return None
    if profiler is None:
        raise RuntimeError("selfspec_profile_steps: start it first (start=True)")
    profiler.stop()
    runner.selfspec_step_profiler = None
    operators = [{"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                 for e in operators_by_self_time(profiler)]
    # Summed in the listed order, so the total is never below the top's sum.
    return {"self_ms": sum(op["self_ms"] for op in operators), "operators": operators[:top]}


class StepPieceTimer:
    """Wraps the runner's step pieces (and the drafter's) in timers,
    on this runner instance only, counting decode steps only: a step that
    schedules a new request's prompt is left out."""

    def __init__(self, runner):
        self.record: dict[str, list] = {}
        self.decoding = False
        owners = [(runner, name) for name in RUNNER_PIECES]
        drafter = getattr(runner, "drafter", None)
        owners += [(drafter, name) for name in DRAFTER_PIECES if hasattr(drafter, name)]
        for owner, name in owners:
            label = name if owner is runner else f"drafter.{name}"
            setattr(owner, name, self._timed(getattr(owner, name), label))

    def _timed(self, method: Callable, label: str) -> Callable:
        def timed(*args, **kwargs):
            if label == "execute_model":  # a step starts: args[0] is its schedule
                self.decoding = not args[0].scheduled_new_reqs
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if self.decoding:
                    entry = self.record.setdefault(label, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - started

        return timed


def measure_step_costs(worker, batch_size: int = 1, repeats: int = 30,
                       uncompiled: bool = False) -> dict:
    """Median seconds of a plain step and a draft step, and their ratio;
    `uncompiled` times the same plan's eager draft too."""
    runner = worker.model_runner
    drafter = runner.drafter
    plain = time_forward(runner.model, runner.vllm_config, batch_size, repeats)
    draft = time_forward(drafter.model, drafter.vllm_config, batch_size, repeats)
    plan = drafter.model.plan
    if uncompiled:
        eager = time_forward(drafter.eager_draft(plan), drafter.vllm_config, batch_size,
                              repeats)
        extra = {"uncompiled_draft_step_s": eager, "uncompiled_cost_ratio": eager / plain}
    else:
        extra = {}
    return {**extra,
        "plain_step_s": plain,
        "draft_step_s": draft,
        "cost_ratio": draft / plain,
        "fraction_of_sublayers_run": plan.fraction_run,
        "plan": plan.describe(),
        "draft_precision": drafter.draft_weights.precision,
        "draft_copy_bytes": drafter.draft_weights.extra_bytes,
        "model_bytes": drafter.draft_weights.model_bytes,
    }


# Options a running drafter may take over RPC: read every round, and not part
# of any compiled graph or file path.
SETTABLE_OPTIONS = frozenset({
    "threshold", "adaptive_threshold", "target_acceptance", "threshold_step",
    "acceptance_smoothing", "threshold_smoothing", "exit_layer", "draft_length",
    "step_overhead", "decay", "confidence", "stop_matchness", "cost_aware",
    "probe_every"})


def set_option(options, name: str, value) -> None:
    from pydantic import TypeAdapter, ValidationError

    from vllm_selfspec.config import COMMON_FIELDS, SelfSpecConfigError, eval_field_type

    if value is None:
        raise ValueError(f"{name}: give a value, not None")
    settable = SETTABLE_OPTIONS & {*options.own_fields(), *COMMON_FIELDS}
    if not isinstance(name, str) or name not in settable:
        raise ValueError(f"{name!r} is not an option of {options.method} that can change "
                         f"while serving; those are {sorted(settable)}")
    field_type = eval_field_type(type(options), type(options).__dataclass_fields__[name].type)
    try:
        value = TypeAdapter(field_type).validate_python(value)
    except ValidationError as error:
        raise ValueError(f"{name}: {error.errors()[0]['msg']}") from None
    previous = getattr(options, name)
    setattr(options, name, value)
    try:
        options.check_ranges()  # the start-up checks, every one
        options.validate_common_fields()
        options.validate_method_fields()
        if options.target_model_config is not None:
            options.validate_for_model(options.target_model_config.hf_config.num_hidden_layers)
    except Exception as error:
        setattr(options, name, previous)
        if isinstance(error, SelfSpecConfigError):
            raise
        raise ValueError(f"{name}: {value!r} does not fit ({error})") from None


def set_skip_set(worker, attn_skip: list[int], mlp_skip: list[int]) -> str:
    """Make the drafter skip these sub-blocks (used by the skip-set search);
    indices are checked like a config's."""
    from vllm_selfspec.config import check_layer_indices
    from vllm_selfspec.draft.plan import LayerPlan

    drafter = worker.model_runner.drafter
    num_layers = drafter.model.plan.num_layers
    for field, indices in (("attn_skip", attn_skip), ("mlp_skip", mlp_skip)):
        if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
            raise ValueError(f"{field}: give a list of layer indices")
        check_layer_indices(field, indices, num_layers)
    plan = LayerPlan.skipping(num_layers, attn_skip, mlp_skip)
    drafter.replace_layer_plan(plan)
    return plan.describe()
