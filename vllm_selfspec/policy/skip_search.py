"""SWIFT's on-the-fly skip-set search (Xia et al., 2025, section 4).

The search space is the attention and MLP sub-blocks of layers 1..L-2 (the
first and last layers always run): a pool of 2(L-2) sub-blocks of which a skip
set skips n = int(2(L-2) * ratio). Each optimisation step scores one candidate
by its matchness on a window of tokens the target produced; the candidate
replaces the incumbent only when it scores strictly higher. Candidates are
uniform random n-subsets, except every `bayes_interval`-th, which Bayesian
optimisation (a Gaussian process with UCB, kappa 2.5, over [0, 1]^pool, the
top-n coordinates skipped) suggests from every scored candidate. The search
ends when the incumbent's matchness exceeds `stop_matchness`, after
`max_tolerance` candidates in a row that did not improve it, or after
`max_iterations` candidates.

A cost-aware engine also weighs the search against its cost
(`search_outlook`): a set can at best match `stop_matchness` of the target's
tokens, and at the engine's measured draft costs that is worth a speed-up
over plain decoding (tokens per plain step at the best draft length) that may
be none at all (the search waits: nothing it could find would draft at a
profit) or barely above the incumbent's (the search ends: it cannot gain
enough to pay for itself).

Everything here is a function of the scores and a seeded generator, so ranks
that see the same scores hold the same search.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from vllm_selfspec.draft.plan import LayerPlan
from vllm_selfspec.policy.payoff import StepCosts, best_speed


@dataclass(frozen=True)
class SkipSet:
    """Skipped sub-blocks, as indices into the pool: attention of layers
    1..L-2 first, then their MLPs."""

    skipped: tuple[int, ...]
    num_layers: int

    @property
    def pool_size(self) -> int:
        return 2 * (self.num_layers - 2)

    @property
    def attn_skip(self) -> list[int]:
        middle = self.num_layers - 2
        return [1 + j for j in self.skipped if j < middle]

    @property
    def mlp_skip(self) -> list[int]:
        middle = self.num_layers - 2
        return [1 + j - middle for j in self.skipped if j >= middle]

    def plan(self) -> LayerPlan:
        return LayerPlan.skipping(self.num_layers, self.attn_skip, self.mlp_skip)

    def as_vector(self) -> np.ndarray:
        vector = np.zeros(self.pool_size)
        vector[list(self.skipped)] = 1.0
        return vector

    @classmethod
    def uniform(cls, num_layers: int, count: int) -> SkipSet:
        """`count` sub-blocks spread evenly: whole layers (attention and MLP) at
        evenly spaced depths, the last one's MLP kept when `count` is odd."""
        middle = num_layers - 2
        layers = np.linspace(0, middle - 1, (count + 1) // 2).round().astype(int)
        skipped = sorted({int(j) for j in layers} | {int(j) + middle for j in layers})
        if count % 2:
            skipped.remove(int(layers[-1]) + middle)
        return cls(tuple(skipped), num_layers)

    @classmethod
    def top(cls, num_layers: int, scores: np.ndarray, count: int) -> SkipSet:
        """The `count` pool entries with the highest scores."""
        return cls(tuple(sorted(int(j) for j in np.argsort(-scores, kind="stable")[:count])),
                   num_layers)


def skip_count(num_layers: int, ratio: float) -> int:
    return int(2 * (num_layers - 2) * ratio)


def search_outlook(incumbent_score: float | None, ceiling: float, costs: StepCosts,
                   max_drafts: int, min_gain: float) -> Literal["futile", "converged", "open"]:
    """Whether one more candidate can pay, at these draft costs: "futile" when
    even a set matching `ceiling` of the tokens would not beat plain decoding
    by `min_gain`, "converged" when it would not beat the incumbent's speed by
    `min_gain`, else "open"."""
    best = best_speed(ceiling, costs, max_drafts)
    if best < 1.0 + min_gain:
        return "futile"
    if best < (1.0 + min_gain) * best_speed(incumbent_score or 0.0, costs, max_drafts):
        return "converged"
    return "open"


def rounds_until_next_search(cost_in_plain_steps: float | None, share: float) -> int:
    """Engine rounds to wait after a search step so that scoring costs at most
    `share` of decoding; a step of unknown cost counts as one plain step."""
    return max(1, math.ceil((1.0 if cost_in_plain_steps is None else cost_in_plain_steps)
                            / share))


def ucb_acquisition(kappa: float, seed: int, lbfgs_starts: int = 2):
    """UCB whose acquisition optimiser uses fewer random samples and L-BFGS
    restarts than bayes_opt's defaults: in 2L dimensions the defaults, not the
    model, dominate the time of a suggestion. With `lbfgs_starts=0` only the
    2000 random samples are ranked, fast enough for a
    search inside the serving loop, whose suggestions are rounded to a set
    anyway."""
    from bayes_opt import acquisition

    class CheapUCB(acquisition.UpperConfidenceBound):
        def suggest(self, gp, target_space, n_random=2000, n_smart=lbfgs_starts,
                    fit_gp=True, random_state=None):
            return super().suggest(gp, target_space, n_random=n_random,
                                   n_smart=n_smart, fit_gp=fit_gp,
                                   random_state=random_state)

    return CheapUCB(kappa=kappa, random_state=seed)


@dataclass
class SearchSettings:
    ratio: float
    bayes_interval: int
    kappa: float
    stop_matchness: float
    max_tolerance: int
    max_iterations: int
    seed: int


@dataclass
class SkipSetSearch:
    """One task's search: the incumbent, its score on the current window, and
    the optimiser's memory."""

    num_layers: int
    settings: SearchSettings
    incumbent: SkipSet = None
    incumbent_score: float | None = None  # on the current scoring window
    iterations: int = 0
    tolerance: int = 0
    ended_by: str | None = None  # matchness | tolerance | iterations | gain
    history: list[dict] = field(default_factory=list)  # per candidate
    windows: list[dict] = field(default_factory=list)  # per scoring window

    def __post_init__(self) -> None:
        self.count = skip_count(self.num_layers, self.settings.ratio)
        self.uniform = SkipSet.uniform(self.num_layers, self.count)
        if self.incumbent is None:
            self.incumbent = self.uniform
        self.rng = np.random.default_rng(self.settings.seed)
        self._keys = [f"block_{j:03d}" for j in range(2 * (self.num_layers - 2))]
        self._optimizer = None
        self._registered: set[SkipSet] = set()

    def next_candidate(self) -> SkipSet:
        interval = self.settings.bayes_interval
        if interval and (self.iterations + 1) % interval == 0 and self.iterations > 0:
            point = self.optimizer.suggest()
            scores = np.array([point[key] for key in self._keys])
            return SkipSet.top(self.num_layers, scores, self.count)
        chosen = self.rng.choice(len(self._keys), size=self.count, replace=False)
        return SkipSet(tuple(sorted(int(j) for j in chosen)), self.num_layers)

    def rescore(self, score: float, uniform_score: float) -> None:
        """The incumbent's and the uniform set's matchness on a new window."""
        self.incumbent_score = score
        self.windows.append({"iteration": self.iterations, "incumbent": score,
                             "uniform": uniform_score})

    def report(self) -> dict:
        return {"iterations": self.iterations, "done": self.done, "ended_by": self.ended_by,
                "attn_skip": self.incumbent.attn_skip, "mlp_skip": self.incumbent.mlp_skip,
                "incumbent_score": self.incumbent_score, "windows": self.windows,
                "history": self.history}

    def record(self, candidate: SkipSet, score: float) -> bool:
        """Score one candidate; True if it became the incumbent."""
        if self.settings.bayes_interval and candidate not in self._registered:
            # The GP (only with Bayesian suggestions) takes each point once.
            self._registered.add(candidate)
            self.optimizer.register(params=dict(zip(self._keys, candidate.as_vector())),
                                    target=score)
        self.iterations += 1
        improved = score > self.incumbent_score
        if improved:
            self.incumbent, self.incumbent_score, self.tolerance = candidate, score, 0
            if score > self.settings.stop_matchness:
                self.end("matchness")
        else:
            self.tolerance += 1
        if not self.done and self.tolerance >= self.settings.max_tolerance:
            self.end("tolerance")
        if not self.done and self.iterations >= self.settings.max_iterations:
            self.end("iterations")
        self.history.append({"iteration": self.iterations, "score": score,
                             "incumbent_score": self.incumbent_score, "done": self.done})
        return improved

    @property
    def done(self) -> bool:
        return self.ended_by is not None

    def end(self, reason: str) -> None:
        self.ended_by = reason

    @property
    def optimizer(self):
        if self._optimizer is None:
            from bayes_opt import BayesianOptimization

            self._optimizer = BayesianOptimization(
                f=None, pbounds=dict.fromkeys(self._keys, (0.0, 1.0)),
                acquisition_function=ucb_acquisition(self.settings.kappa, self.settings.seed,
                                                     lbfgs_starts=0),
                random_state=self.settings.seed, verbose=0)
            # Noisy scores (the reference's alpha), one kernel fit per suggestion.
            self._optimizer._gp.set_params(alpha=1e-2, n_restarts_optimizer=0)
        return self._optimizer


# --- tasks: whose searches are held -----------------------------------------
DEFAULT_TASK = "default"
TASK_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def task_name(key: object) -> str | None:
    """A request's task key if it is a valid task name, else None."""
    return key if isinstance(key, str) and TASK_NAME.fullmatch(key) else None


class TaskSlots:
    """The tasks whose searches are held: at most `capacity`, "default"
    (always held) included. A request's key names its task if it is a valid
    task name; a new one takes a free slot, else the slot of the least
    recently used task no request of the batch belongs to (that task's
    search is dropped: it starts again if the task comes back); when every
    held task is in the batch, the request joins "default". Invalid keys join
    "default" too. Refusals and expiries are counted, per request and round."""

    def __init__(self, capacity: int, new_search: Callable[[], SkipSetSearch]):
        self.capacity = capacity
        self.new_search = new_search
        self.searches: OrderedDict[str, SkipSetSearch] = OrderedDict()  # least recent first
        self.refused: Counter[str] = Counter()
        self.expired = 0

    def assign(self, keys: list[object]) -> list[str]:
        """Each request's task, for the requests of one batch (by their keys;
        None: no key sent)."""
        if DEFAULT_TASK not in self.searches:
            self.searches[DEFAULT_TASK] = self.new_search()
        names = []
        for key in keys:
            name = DEFAULT_TASK if key is None else task_name(key)
            if name is None:
                self.refused["invalid"] += 1
            names.append(name or DEFAULT_TASK)
        in_batch = {DEFAULT_TASK} | {name for name in names if name in self.searches}
        tasks = []
        for name in names:
            if name not in self.searches and not self._make_room(in_batch):
                self.refused["over_max_tasks"] += 1
                name = DEFAULT_TASK
            if name not in self.searches:
                self.searches[name] = self.new_search()
                in_batch.add(name)
            tasks.append(name)
        for name in dict.fromkeys(tasks):
            self.searches.move_to_end(name)
        return tasks

    def _make_room(self, in_batch: set[str]) -> bool:
        if len(self.searches) < self.capacity:
            return True
        idle = next((task for task in self.searches if task not in in_batch), None)
        if idle is None:
            return False
        del self.searches[idle]
        self.expired += 1
        return True


class CompileBudget:
    """Learned sets compile (while requests wait) in at most `share` of the
    time: after a compile that took s seconds, the next may start s / share
    seconds after this one started. Bounded per time, however many task keys
    clients send."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic):
        self.share = share
        self.clock = clock
        self.next_allowed = -math.inf

    def allows(self) -> bool:
        return self.clock() >= self.next_allowed

    def spent(self, started: float, seconds: float) -> None:
        self.next_allowed = started + seconds / self.share
