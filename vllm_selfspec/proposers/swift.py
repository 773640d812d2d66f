"""SWIFT (Xia et al., ICLR 2025): a skip set learned while serving, and
confidence-aware drafting.

The engine starts drafting with a uniform skip set at `skip_ratio`. Once a
request of a task has generated `context_window` + 1 tokens, each round that
self-drafts (every `optimise_every`-th; with `cost_aware`, rounds that decline
to draft do not search) scores one candidate skip set by its matchness on
that window: how many of the window's next tokens the candidate's draft
predicts, in one read-only forward of the window over the target's own paged
KV (the window's tokens attend to the target's K/V; nothing is written). The
search (`policy/skip_search.py`) keeps the best set and stops at high
matchness or when it stalls; its cost is one W-token forward per step while it
runs and nothing after. With `cost_aware` (the default) the search also pays
its way: a step scores only where a set matching `stop_matchness` of the
tokens would draft at a profit at the engine's measured costs, the search ends
once no set could beat the incumbent by MIN_GAIN, and steps are spaced so that
scoring takes at most `search_share` of decoding (its cost timed per step, in
plain steps, rank 0's on every rank).

State is per task: a request names its task in `SamplingParams.extra_args`
(`{"selfspec_task": "code"}`, `vllm_xargs` over HTTP); requests without one
share the task "default". A task key is 1-64 characters of [A-Za-z0-9_-]
(it names an exported file). At most `max_tasks` searches are held: a new
key takes the slot of the least recently used task no request of the batch
belongs to (its search is dropped, and starts again if the task returns);
a request with an invalid key, or a new key while every held task is in the
batch, joins "default" (counted in the search report), so a client can
neither write outside `export_dir` nor grow the server's state. A round
drafts with the skip set of the task most of its requests belong to. Eager
engines draft with each new incumbent at once; compiled engines keep the
uniform set's compiled graph while a task's search runs and compile its final
set once the search ends (`compile_learned_set`: requests wait while it
compiles; compiles take at most COMPILE_SHARE of the time, however many keys
clients send: a set that may not compile yet drafts uncompiled meanwhile;
off, it always drafts uncompiled).

Drafting stops after a token whose top-1 probability is below `confidence`,
at most `num_speculative_tokens` (25) a round. Cost-aware, a round drafts with
the set only where its measured acceptance and step cost beat the full-depth
draft over the same weights (`full_depth`, `policy/mechanism_gate.py`); the
other rounds are that base's, as `draft_verify` drafts at its defaults. Verification is vLLM's chain
rejection sampler; why there is no token tree is in docs/swift-design.md.

On tensor-parallel ranks the candidate comes from rank 0 and every rank takes
rank 0's scores, so all ranks hold the same search and draft the same set.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import nn
from vllm.config.utils import config
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_selfspec.config import Option, SelfSpecConfigError
from vllm_selfspec.draft.choice import DraftChoiceConfig
from vllm_selfspec.draft.plan import LayerPlan
from vllm_selfspec.draft.tokens import top1_probability
from vllm_selfspec.policy.payoff import StepCosts
from vllm_selfspec.policy.rounds import MIN_GAIN
from vllm_selfspec.policy.skip_search import (
    CompileBudget,
    SearchSettings,
    SkipSet,
    SkipSetSearch,
    TaskSlots,
    rounds_until_next_search,
    search_outlook,
    skip_count,
    task_name,
)
from vllm_selfspec.proposers.base import SelfSpecProposer, VerifiedTokens
from vllm_selfspec.proposers.draft_metadata import request_window

TASK_KEY = "selfspec_task"
# Learned sets compile in at most this share of the time (CompileBudget).
COMPILE_SHARE = 0.1

logger = init_logger(f"vllm.{__name__}")


def compiled_frames() -> int:
    """Frames `torch.compile` has traced in this process (dynamo's own count)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def _check_writable(export_dir: str) -> None:
    """Create `export_dir` and write a file in it, or fail at start-up."""
    try:
        Path(export_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(export_dir) / ".selfspec-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise SelfSpecConfigError(
            f"speculative_config.export_dir: cannot write into {export_dir!r} ({error}); "
            "give a directory this server may write, or leave export_dir out.") from None


def export_path(export_dir: str, task: str) -> Path:
    """`<export_dir>/<task>.json`, refused unless it stays inside export_dir."""
    root = Path(export_dir).resolve()
    path = (root / f"{task}.json").resolve()
    if task_name(task) is None or path.parent != root:
        raise ValueError(f"task {task!r} is not a valid task name")
    return path


@config
class SwiftConfig(DraftChoiceConfig):
    method: Literal["swift"] = "swift"
    skip_ratio: Annotated[float | None, Option(0.45, ge=0, le=1)] = None
    """r: the share of the 2(L-2) attention and MLP sub-blocks of layers
    1..L-2 a skip set skips (the first and last layers always run)."""
    context_window: Annotated[int | None, Option(32, ge=1)] = None
    """W: a task's search starts when one of its requests has generated W+1
    tokens; candidates are scored on that request's first W+1 generated
    tokens."""
    optimise_every: Annotated[int | None, Option(1, ge=1)] = None
    """Engine steps per optimisation step (one candidate scored per step)."""
    bayes_interval: Annotated[int | None, Option(25, ge=0)] = None
    """Every n-th candidate comes from Bayesian optimisation (GP, UCB), the
    rest are uniform random sets; 0: random only."""
    bayes_kappa: Annotated[float | None, Option(2.5, ge=0)] = None
    """kappa, UCB's exploration weight."""
    stop_matchness: Annotated[float | None, Option(0.95, ge=0, le=1)] = None
    """A task's search ends when its best set's matchness exceeds this..."""
    max_tolerance: Annotated[int | None, Option(300, ge=1)] = None
    """...or after this many candidates in a row without improvement..."""
    max_iterations: Annotated[int | None, Option(1000, ge=1)] = None
    """...or after this many candidates."""
    confidence: Annotated[float | None, Option(0.8, ge=0, le=1)] = None
    """Stop drafting after a token whose top-1 probability is below this."""
    search_seed: Annotated[int | None, Option(0, ge=0, lt=2**32)] = None
    """The seed of the candidate generator."""
    export_dir: str | None = None
    """When a task's search ends, write its set to `<export_dir>/<task>.json`,
    a config file `draft_verify` reads (`"config_file":
    "<export_dir>/code.json"`). Default: not written."""
    max_tasks: Annotated[int | None, Option(8, ge=1)] = None
    """The most task searches held at once, "default" included; a new key
    beyond that takes the least recently used idle task's slot."""
    search_share: Annotated[float | None, Option(0.02, gt=0, le=1)] = None
    """With cost_aware, at most this share of decoding goes to scoring
    candidates: each step's measured cost (in plain steps) spaces the next.
    The search also scores only where a set matching stop_matchness of the
    tokens would draft at a profit at the engine's measured costs, and ends
    once no set could beat its best by 5 %. cost_aware false is the paper's
    schedule, a step every optimise_every."""
    compile_learned_set: Annotated[bool | None, Option(True)] = None
    """In a compiled engine (not enforce_eager), compile a task's set when its
    search ends, once per task, while requests wait
    (`scripts/lab/swift_compile.py` times it); false: the set drafts
    uncompiled."""

    default_num_speculative_tokens = 25

    def validate_method_fields(self) -> None:
        if self.bayes_interval > 0 and importlib.util.find_spec("bayes_opt") is None:
            raise SelfSpecConfigError(
                "speculative_config.bayes_interval: SWIFT's Bayesian search needs the "
                "bayesian-optimization package; `pip install bayesian-optimization==3.4.0`, "
                "or set bayes_interval to 0 (random candidates only).")
        if self.export_dir is not None:
            _check_writable(self.export_dir)

    def validate_for_model(self, num_layers: int) -> None:
        if num_layers < 3 or skip_count(num_layers, self.skip_ratio) < 1:
            raise SelfSpecConfigError(
                f"speculative_config.skip_ratio: {self.skip_ratio} of the "
                f"{2 * max(num_layers - 2, 0)} skippable sub-blocks of this "
                f"{num_layers}-layer model is nothing to skip; raise it.")

    def method_hash_factors(self) -> list:
        return [self.skip_ratio]  # the uniform set: the draft graph compiled at load

    def search_settings(self) -> SearchSettings:
        return SearchSettings(
            ratio=self.skip_ratio, bayes_interval=self.bayes_interval, kappa=self.bayes_kappa,
            stop_matchness=self.stop_matchness, max_tolerance=self.max_tolerance,
            max_iterations=self.max_iterations, seed=self.search_seed)


class SwiftProposer(SelfSpecProposer):
    options: SwiftConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tasks = TaskSlots(self.options.max_tasks, lambda: SkipSetSearch(
            self.model.plan.num_layers, self.options.search_settings()))
        self.window_owner: dict[str, str] = {}  # task -> request scored on
        self.compile_budget = CompileBudget(COMPILE_SHARE)
        self.engine_steps = 0
        self.optimise_seconds = 0.0  # for reports only, never for decisions
        self.scoring_compiles = 0  # torch.compile frames traced while scoring: reports only
        self.next_search_round = 0  # cost-aware: the engine round a step may score in
        # cost-aware: rounds that would have scored had any set been able to pay
        self.futile_rounds = 0
        from vllm.config import CompilationMode

        self.eager = self.vllm_config.compilation_config.mode == CompilationMode.NONE
        self.compiled_drafts: dict[SkipSet, nn.Module] = {}  # compiled engines: held tasks' sets
        self.compile_seconds: dict[str, float] = {}  # held task -> seconds requests waited

    def layer_plan(self, num_layers: int) -> LayerPlan:
        self.drafting_set = self.uniform_set(num_layers)
        return self.drafting_set.plan()

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        self.compiles_drafts = not getattr(self.model, "do_not_compile", True)
        if self.compiles_drafts:
            self.compiled_drafts[self.drafting_set] = self.model

    def time_costs(self) -> None:
        """Also runs the uncompiled draft once at the scoring window's size and
        at one token (a learned set drafting uncompiled): in a compiled engine
        its first call traces vLLM's compiled activation, a wait a user's
        request would otherwise pay."""
        super().time_costs()
        from vllm_selfspec.proposers.timing import warm_up

        draft = self.eager_draft(self.drafting_set.plan())
        for num_tokens in sorted({1, self.options.context_window}):
            warm_up(draft, self.vllm_config, num_tokens)

    def uniform_set(self, num_layers: int) -> SkipSet:
        return SkipSet.uniform(num_layers, skip_count(num_layers, self.options.skip_ratio))

    def stop_after(self, req_ids, logits, step):
        return top1_probability(logits) < self.options.confidence

    # --- tasks ---------------------------------------------------------------
    def tasks_of(self, req_ids: list[str]) -> list[str]:
        """Each request's task (TaskSlots: refusals and expiries are counted,
        not logged per request); an expired task's window and compiled set go
        with it."""
        tasks = self.tasks.assign([
            (self.runner.requests[req_id].sampling_params.extra_args or {}).get(TASK_KEY)
            for req_id in req_ids])
        for held_by_task in (self.window_owner, self.compile_seconds):
            for task in set(held_by_task) - set(self.tasks.searches):
                del held_by_task[task]
        kept = {self.drafting_set, *(search.incumbent for search in self.tasks.searches.values())}
        for skip_set in set(self.compiled_drafts) - kept:
            del self.compiled_drafts[skip_set]
        return tasks

    def begin_round(self, req_ids: list[str], verified: VerifiedTokens) -> None:
        tasks = self.tasks_of(req_ids)
        self.engine_steps += 1
        costs = (self.policy.timed_costs(len(req_ids))
                 if self.options.cost_aware else None)  # a drafting round has costs
        if (self.engine_steps % self.options.optimise_every == 0
                and (costs is None or self.policy.round_index >= self.next_search_round)):
            started, frames = time.perf_counter(), compiled_frames()
            scored = self.optimise(req_ids, tasks, verified, costs)
            seconds = time.perf_counter() - started
            self.optimise_seconds += seconds
            self.scoring_compiles += compiled_frames() - frames
            if scored and costs is not None:
                self.space_search(len(req_ids), seconds)
        counts = Counter(tasks)
        majority = min(counts, key=lambda task: (-counts[task], task))
        search = self.tasks.searches[majority]
        if search.done or self.eager:
            self.draft_with(search.incumbent, majority)

    def draft_with(self, skip_set: SkipSet, task: str) -> None:
        """Draft with `skip_set` from this round on: its compiled draft if it
        has one or may compile now, else uncompiled (a compiled engine tries to
        compile it again in later rounds, within the compile budget)."""
        compiled = skip_set in self.compiled_drafts
        wants_compile = self.compiles_drafts and self.options.compile_learned_set
        if skip_set == self.drafting_set and (compiled or not wants_compile):
            return
        if compiled:
            self.model = self.compiled_drafts[skip_set]
        elif wants_compile and self.agreed(self.compile_budget.allows()):
            self.model = self.compiled_drafts[skip_set] = self.compile_draft(skip_set, task)
        elif skip_set != self.drafting_set:
            self.replace_layer_plan(skip_set.plan())
        self.drafting_set = skip_set

    def compile_draft(self, skip_set: SkipSet, task: str) -> nn.Module:
        """The set's draft, compiled now, in the worker's own thread (a
        compile in a background thread breaks the forwards running beside it:
        tracing patches `nn.Module.__call__` process-wide). Nothing is written
        for it to vLLM's graph cache, and nothing saved is ever loaded: all
        learned sets share one cache key, under which no graph is saved."""
        from vllm.config import set_current_vllm_config

        started = self.compile_budget.clock()
        with set_current_vllm_config(self.vllm_config):
            draft = self._build_draft(skip_set.plan(), cache_key="learned_set")
        draft.save_aot_compiled_function = lambda: None
        tokens = torch.zeros(8, dtype=torch.int32, device=self.device)
        with set_forward_context(None, self.vllm_config, num_tokens=8):  # compiles
            draft(tokens, torch.zeros(8, dtype=torch.int64, device=self.device))
        seconds = self.compile_budget.clock() - started
        self.compile_budget.spent(started, seconds)
        self.compile_seconds[task] = seconds
        return draft

    # --- the search ----------------------------------------------------------
    def optimise(self, req_ids: list[str], tasks: list[str], verified: VerifiedTokens,
                 costs: StepCosts | None) -> bool:
        """One optimisation step for the first task (by name) still searching
        that has a request with a full window; with `costs` (cost-aware), only
        where a candidate can pay (`search_outlook`). True if it scored."""
        for task in sorted(set(tasks)):
            search = self.tasks.searches[task]
            if search.done:
                continue
            row = self.scoring_row(task, req_ids, tasks, verified)
            if row is None:
                continue
            if costs is not None and self.outlook(None, costs) == "futile":
                self.futile_rounds += 1
                return False
            if self.window_owner.get(task) != req_ids[row]:
                self.window_owner[task] = req_ids[row]
                score = self.matchness(search.incumbent, row, verified)
                uniform = score if search.incumbent == search.uniform else (
                    self.matchness(search.uniform, row, verified))
                search.rescore(*self.agreed((score, uniform)))
            if costs is not None and self.outlook(search.incumbent_score, costs) == "converged":
                search.end("gain")
            else:
                candidate = self.agreed(search.next_candidate())
                search.record(candidate, self.agreed(self.matchness(candidate, row, verified)))
            if search.done:
                self.export(task, search)
            return True
        return False

    def outlook(self, incumbent_score: float | None, costs: StepCosts) -> str:
        return search_outlook(incumbent_score, self.options.stop_matchness, costs,
                              self.options.num_speculative_tokens, MIN_GAIN)

    def space_search(self, batch_size: int, seconds: float) -> None:
        """The next search step waits until this one's cost (rank 0's, in its
        plain steps) is at most `search_share` of the rounds since."""
        plain = self.policy.plain_seconds(batch_size)
        cost = self.agreed(None if plain is None else seconds / plain)
        self.next_search_round = self.policy.round_index + rounds_until_next_search(
            cost, self.options.search_share)

    def scoring_row(self, task, req_ids, tasks, verified) -> int | None:
        """The request whose first W + 1 generated tokens score the task's
        candidates: the current one while it runs, else the first in the batch."""
        owner = self.window_owner.get(task)
        rows = [row for row, t in enumerate(tasks) if t == task]
        rows.sort(key=lambda row: req_ids[row] != owner)
        for row in rows:
            if self.window_start(req_ids[row]) + self.options.context_window <= int(
                    verified.positions[verified.last_rows[row]]):
                return row
        return None

    def window_start(self, req_id: str) -> int:
        return self.runner.requests[req_id].num_prompt_tokens

    def matchness(self, skip_set: SkipSet, row: int, verified: VerifiedTokens) -> float:
        """Share of the window's next tokens the set's draft predicts: the
        window's W tokens through the set's sub-blocks in one forward that
        reads the target's KV and writes none (empty slot mapping)."""
        width = self.options.context_window
        start = self.window_start(self.runner.input_batch.req_ids[row])
        tokens = torch.from_numpy(
            self.runner.input_batch.token_ids_cpu[row, start:start + width + 1]).to(
                self.device, torch.int64)
        cad, positions = request_window(verified.attn_metadata, row, start, width, self.device)
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(cad)
        with self.draft_forward_context(per_layer_metadata, width, {}):
            draft = self.eager_draft(skip_set.plan())
            logits = draft.compute_logits(draft(tokens[:width].to(torch.int32), positions))
        return float((logits.argmax(dim=-1) == tokens[1:]).float().mean())

    def agreed(self, value):
        """Rank 0's value on every tensor-parallel rank."""
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast_object(value, src=0)

    def export(self, task: str, search: SkipSetSearch) -> None:
        if self.options.export_dir is None:
            return
        from vllm.distributed import get_tp_group

        if get_tp_group().rank_in_group != 0:
            return
        path = export_path(self.options.export_dir, task)
        best = search.incumbent
        settings = {"attn_skip": best.attn_skip, "mlp_skip": best.mlp_skip,
                    "num_speculative_tokens": self.options.num_speculative_tokens}
        record = {
            "model": self.vllm_config.model_config.model,
            "num_hidden_layers": best.num_layers,
            "methods": {"draft_verify": settings},
            "how_made": f"SWIFT's on-line search, task '{task}', "
                        f"{search.iterations} candidates",
            "matchness": search.windows[-1],
        }
        try:
            path.write_text(json.dumps(record, indent=2))
        except OSError as error:  # checked at start-up; a later failure is logged
            logger.warning("SWIFT could not export task %r's skip set to %s: %s",
                           task, path, error)

    def search_report(self) -> dict:
        return {"tasks": {task: search.report()
                          for task, search in self.tasks.searches.items()},
                "drafting": {"attn_skip": self.drafting_set.attn_skip,
                             "mlp_skip": self.drafting_set.mlp_skip,
                             "compiled": self.drafting_set in self.compiled_drafts},
                "compile_seconds": dict(self.compile_seconds),
                "optimise_seconds": self.optimise_seconds,
                "scoring_compiles": self.scoring_compiles,
                "futile_rounds": self.futile_rounds,
                "refused_task_keys": dict(self.tasks.refused),
                "expired_tasks": self.tasks.expired}

    def forget_finished(self, live_req_ids: set[str]) -> None:
        for task, owner in list(self.window_owner.items()):
            if owner not in live_req_ids:
                del self.window_owner[task]

    def per_request_state(self) -> dict[str, int]:
        """Window owners are requests; searches are per task (at most
        `max_tasks`), reported beside them."""
        return {**super().per_request_state(), "window_owners": len(self.window_owner),
                "tasks": len(self.tasks.searches)}


CONFIG_CLASS = SwiftConfig
PROPOSER_CLASS = SwiftProposer
