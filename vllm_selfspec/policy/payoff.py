"""Whether drafting pays, per request and round: the cost-aware draft budget.

A round that drafts k tokens costs 1 + F + k w plain decode steps: the
verification forward (a plain step), the round's fixed extra F (the draft
loop's set-up, the rejection sampler, bookkeeping) and per draft token w (its
draft step and its share of the verification). It yields on average
E(k) = 1 + a + ... + a^k tokens when each draft is accepted with probability a
(given the one before was). Plain decoding yields 1 token per plain step, so
drafting k pays when E(k) / (1 + F + k w) > 1. The budget is the k in 0..K
that maximises that ratio, and 0 unless it beats 1 by `margin`. A draft step
runs every row of the batch, so at batch B the round drafts the number of steps
whose drafting requests' extra tokens together best beat B times the extra
cost (`batch_steps`); at batch 1 that is the request's own budget.

`a` is the request's own: decayed counts of accepted drafts and of rounds that
ended in a rejection, a / (1 - a) being accepted drafts per rejection, with a
prior worth two rounds: the engine's record over every request's drafts of
that kind (the same counts, possibly decayed more slowly: the long run), so a
new request starts where this draft stands. A request whose budget is 0 drafts
nothing, so its own counts stop moving; a few rejections in a row (the counts'
noise, not the text) would then keep it from drafting for the rest of its
output. So a record may also forget in the engine rounds its request drafts
nothing in (`idle_decay` per round): a request that stopped drafting drifts
back to the engine's record and tries again, at the budget that record is
worth, and stops again if its text still rejects (the proposer does this for
self-drafts, not for lookups). On every `probe_every`-th round of the engine a
request whose budget is 0 drafts one token anyway, so even where the engine's
record says no, it starts again when its text turns predictable. Probes share
the engine's round clock, so all idle requests probe in the same round and one
draft forward serves them all.

F and w come from the engine's own rounds (`RoundClock`): wall time from one
round's drafting to the next, which is everything a plain vLLM step also pays
(scheduling, the forward, sampling, output handling) plus what drafting adds.
Rounds that verified nothing time a plain step; rounds that drafted k tokens
time 1 + F + k w of them. Until those exist, a stand-in from forward timings
alone serves, per batch size (`ForwardTimes`: the target's forward by the
tokens in it and a draft step by the requests in it, timed at start-up), so a
compute-bound batch, where every verified token adds its share of the
forward, is never budgeted with batch 1's costs. Costs are per batch size
and stand in only for batch sizes of the same bucket (1, 2, 3-4, 5-8, ...): at
a bucket with no plain step timed yet, a round drafts nothing, so one is
timed. Lookup drafts run no draft step: rounds whose drafts were all looked up
time 1 + F_l + n v plain steps for n looked-up tokens, which give a looked-up
token's cost v and a lookup round's fixed extra F_l (`fit_lookup_costs`).
The costs are a model, and a loaded batch is where it errs most (a
verification's attention and the rejection sampler over the batch are in no
start-up forward time; a round that both self-drafts and looks up is timed as
neither). So every round that verified drafts is also scored by what it
yielded per second against a plain round (`GoodputGate`), per batch-size
bucket; a bucket whose drafting rounds were not 5 % faster than plain ones
drafts nothing, except for a try every so many rounds (at most 1 % of decoding), so
it reopens when drafting pays again there.
Every input of a decision is the same on every tensor-parallel rank (the
proposer shares rank 0's costs and closed buckets), so every rank decides the
same.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StepCosts:
    """A drafted round's costs in plain decode steps: per draft token (its
    draft step and its share of the verification), the round's fixed extra
    over a plain step, per looked-up token (its share of the verification
    alone: a lookup runs no draft step; None where not timed), and a lookup
    round's fixed extra (the matcher, the rejection sampler; None until lookup
    rounds were timed: the drafted round's then stands in)."""

    per_draft: float
    round_overhead: float = 0.0
    per_verified: float | None = None
    lookup_overhead: float | None = None

    def for_lookup(self, batch_size: int = 1) -> StepCosts:
        """One request's lookup costs, in its own plain steps: each token costs
        its verification share, and the round a lookup round's fixed extra. At
        batch B these are in plain steps of the batch, which all B requests
        wait through, so one request's lookup pays only for B times them."""
        per_token = self.per_draft if self.per_verified is None else self.per_verified
        overhead = self.round_overhead if self.lookup_overhead is None else self.lookup_overhead
        return StepCosts(per_token * batch_size, overhead * batch_size, per_token * batch_size)


@dataclass(frozen=True)
class ForwardTimes:
    """Seconds of the target's forward by the tokens in it, and of one draft
    step by the requests in it, timed at start-up on a grid (both read linearly
    between grid points and along the last segment beyond it). What a draft
    costs depends on the load: at batch 1 on a CPU a forward over 5 tokens
    costs about what one over 1 does (the weights are read once either way),
    while a batch of 16 is compute-bound and each verified token adds its
    share. These times give each batch size its own stand-in costs
    (`prior_at`) until the engine has timed its own rounds there."""

    tokens: tuple[int, ...]
    target_seconds: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    draft_seconds: tuple[float, ...]

    def target(self, num_tokens: float) -> float:
        return _read_line(self.tokens, self.target_seconds, num_tokens)

    def draft(self, batch_size: float) -> float:
        return _read_line(self.batch_sizes, self.draft_seconds, batch_size)

    def prior_at(self, batch_size: int, max_drafts: int) -> StepCosts:
        """Stand-in costs at `batch_size`, in plain forwards of that batch: a
        draft token's draft step and its share of a verification that carries
        max_drafts drafts per request, and a looked-up token's share of one
        that carries max_drafts more tokens. The engine's plain step also pays
        scheduling and sampling, so these overstate the costs a little: a
        stand-in errs towards drafting less."""
        plain = self.target(batch_size)
        verify = self.target(batch_size * (1 + max_drafts))
        verified = max(verify - plain, 0.0) / (max_drafts * batch_size) / plain
        per_draft = self.draft(batch_size) / plain + verified * batch_size
        looked_up = max(self.target(batch_size + max_drafts) - plain, 0.0) / max_drafts / plain
        return StepCosts(per_draft=per_draft, per_verified=looked_up)

    def describe(self) -> dict:
        return {"target_ms_by_tokens": {n: round(s * 1e3, 3) for n, s in
                                        zip(self.tokens, self.target_seconds)},
                "draft_ms_by_batch": {b: round(s * 1e3, 3) for b, s in
                                      zip(self.batch_sizes, self.draft_seconds)}}


def timing_grid(largest: int) -> tuple[int, ...]:
    """1, 4, 16, ... up to `largest`, which is included (the times are read
    linearly between these points)."""
    sizes = [4 ** i for i in range(8) if 4 ** i < largest]
    return (*sizes, max(largest, 1))


def _read_line(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """y at x on the polyline through (xs, ys), made non-decreasing, and
    extended along its last segment past the ends (never below 0)."""
    ys = tuple(np.maximum.accumulate(ys))
    if len(xs) == 1:
        return float(ys[0] * max(x, 1.0) / xs[0])
    index = min(max(int(np.searchsorted(xs, x)) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[index], xs[index + 1], ys[index], ys[index + 1]
    return max(float(y0 + (y1 - y0) * (x - x0) / (x1 - x0)), 0.0)


@dataclass
class DraftPayoff:
    """One request's acceptance record."""

    accepted: float = 0.0
    rejections: float = 0.0
    last_round: int = 0  # the engine round it last drafted in

    def update(self, accepted: int, verified: int, decay: float) -> None:
        self.add_round(accepted, 1 if accepted < verified else 0, decay)

    def idle_factor(self, now: int, idle_decay: float) -> float:
        """What is left of it at round `now`: `idle_decay` per round since the
        round that verified its last drafts."""
        return idle_decay ** max(now - 1 - self.last_round, 0)

    def forget_idle(self, now: int, idle_decay: float) -> None:
        """Make the idle rounds' forgetting final: it drafts in round `now`."""
        factor = self.idle_factor(now, idle_decay)
        self.accepted *= factor
        self.rejections *= factor
        self.last_round = now

    def add_round(self, accepted: int, rejections: int, decay: float) -> None:
        """One round's accepted drafts and rejections (over one request, or
        summed over the batch for the engine's record)."""
        self.accepted = decay * self.accepted + accepted
        self.rejections = decay * self.rejections + rejections

    def acceptance(self, prior: float, prior_weight: float = 2.0, factor: float = 1.0) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), smoothed;
        `factor` of the counts (what idle rounds left of them)."""
        accepted = factor * self.accepted + prior * prior_weight
        return accepted / (accepted + factor * self.rejections + (1 - prior) * prior_weight)


@dataclass
class AcceptanceRecords:
    """One kind of draft's acceptance records (a method's self-drafts, or its
    lookups): each request's, made by its first verified drafts, and the
    engine's over every request, which is where a new request starts."""

    prior: float  # before the engine has verified any draft of this kind
    decay: float  # a request's record, per round it took feedback in
    engine_decay: float  # the engine's record, per round with feedback
    idle_decay: float  # a request's record, per engine round it drafts nothing in
    requests: dict[str, DraftPayoff] = field(default_factory=dict)
    engine: DraftPayoff = field(default_factory=DraftPayoff)

    def acceptances(self, req_ids: list[str], now: int) -> list[float]:
        """Each request's acceptance at engine round `now`."""
        prior = self.engine.acceptance(self.prior)
        records = [self.requests.get(req_id) for req_id in req_ids]
        return [prior if record is None
                else record.acceptance(prior, factor=record.idle_factor(now, self.idle_decay))
                for record in records]

    def budgets(self, req_ids: list[str], costs: StepCosts, max_drafts: int, margin: float,
                probe: bool, now: int) -> tuple[list[int], list[float]]:
        """Each request's budget this round (`round_budget`) and its acceptance.
        A request given a budget drafts from the record as it stands now."""
        acceptances = self.acceptances(req_ids, now)
        budgets = [round_budget(acceptance, costs, max_drafts, margin, probe)
                   for acceptance in acceptances]
        for req_id, budget in zip(req_ids, budgets):
            if budget and req_id in self.requests:
                self.requests[req_id].forget_idle(now, self.idle_decay)
        return budgets, acceptances

    def add_request_round(self, req_id: str, accepted: int, verified: int, now: int) -> None:
        """Feedback on the drafts a request made in round `now` - 1."""
        self.requests.setdefault(req_id, DraftPayoff(last_round=now - 1)).update(
            accepted, verified, self.decay)

    def add_engine_round(self, accepted: int, rejections: int) -> None:
        """One round's counts summed over the batch."""
        if accepted or rejections:
            self.engine.add_round(accepted, rejections, self.engine_decay)

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the records of requests vLLM no longer holds."""
        for req_id in set(self.requests) - live_req_ids:
            del self.requests[req_id]


@dataclass
class MatchRecords:
    """The engine's acceptance of looked-up drafts by the length of the match
    that found them, one record per length up to `longest` (longer matches
    share the last). A suffix tree's estimate of a continuation (the share of
    the match's past continuations that went on so) reads alike after a
    one-token match and after a twenty-token one, where the target follows
    the first far less often; these records tell them apart. Bounded, and fed
    by verification alone, so alike on every tensor-parallel rank."""

    prior: float  # a length's acceptance before any draft of it was verified
    decay: float  # per round that verified a draft of that length
    longest: int
    records: dict[int, DraftPayoff] = field(default_factory=dict)

    def acceptance(self, match_length: int) -> float:
        """Per-token acceptance of drafts found by matches this long."""
        record = self.records.get(min(match_length, self.longest))
        return self.prior if record is None else record.acceptance(self.prior)

    def add(self, match_length: int, accepted: int, verified: int) -> None:
        """Feedback on one draft found by a match this long."""
        self.records.setdefault(min(match_length, self.longest), DraftPayoff()).update(
            accepted, verified, self.decay)

    def calibrated(self, path_probabilities: list[float], match_length: int) -> list[float]:
        """The chance of each prefix being accepted whole: a^i for the i-th,
        a the acceptance of drafts found by matches this long, times the
        source's own fall along the path past its first token (p_i / p_1:
        where the tree's past continuations branched). The source's level
        (p_1) is not taken: a tree's first estimate reads about a half after a
        one-token match and after a long one alike (a phrase seen once before
        and once now), where the target follows the first far less often than
        the second. Unchanged where the length is unknown (0)."""
        if match_length < 1 or not path_probabilities:
            return path_probabilities
        acceptance = self.acceptance(match_length)
        first = max(path_probabilities[0], 1e-9)
        return [acceptance ** prefix * min(1.0, chance / first)
                for prefix, chance in enumerate(path_probabilities, start=1)]

    def describe(self) -> dict[int, float]:
        return {length: round(self.acceptance(length), 3) for length in sorted(self.records)}


def expected_tokens(acceptance: float, drafts: int) -> float:
    """E(k): tokens a round of k chained drafts yields, the bonus included:
    1 + a + ... + a^k, in closed form (it runs K times per request-round)."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


def _fastest_length(expected: Iterable[float], costs: StepCosts) -> tuple[int, float]:
    """Given the expected tokens of a round of k drafts for k = 1, 2, ...:
    the k with the most tokens per plain step, and that speed ((0, 0) when
    there is no k)."""
    return max(((drafts, tokens / (1.0 + costs.round_overhead + drafts * costs.per_draft))
                for drafts, tokens in enumerate(expected, start=1)),
               key=lambda pair: pair[1], default=(0, 0.0))


def _fastest_draft(acceptance: float, costs: StepCosts, max_drafts: int) -> tuple[int, float]:
    """The k in 1..max_drafts with the most tokens per plain step at
    acceptance `acceptance`, and that speed ((0, 0) when no draft fits)."""
    return _fastest_length((expected_tokens(acceptance, drafts)
                            for drafts in range(1, max_drafts + 1)), costs)


def best_budget(acceptance: float, costs: StepCosts, max_drafts: int,
                margin: float) -> int:
    """The k in 0..max_drafts with the highest tokens per plain step, or 0
    when no k beats plain decoding by `margin`."""
    drafts, speed = _fastest_draft(acceptance, costs, max_drafts)
    return drafts if speed > 1.0 + margin else 0


def best_speed(acceptance: float, costs: StepCosts, max_drafts: int) -> float:
    """Tokens per plain step at the best budget: 1 where drafting loses (it
    then drafts nothing)."""
    return max(1.0, _fastest_draft(acceptance, costs, max_drafts)[1])


def estimated_draft(path_probabilities: list[float], costs: StepCosts,
                    margin: float) -> tuple[int, float]:
    """How much of a draft whose source estimates each prefix's chance of
    being accepted whole (suffix trees: the share of the match's past
    continuations that went on so far) pays, and its speed: the k with the
    most expected tokens per plain step, (1 + p_1 + ... + p_k) / (1 + F + k w),
    and (0, 1) unless it beats plain by `margin`."""
    drafts, speed = _fastest_length(
        (1.0 + total for total in itertools.accumulate(path_probabilities)), costs)
    return (drafts, speed) if speed > 1.0 + margin else (0, 1.0)


def round_budget(acceptance: float, costs: StepCosts, max_drafts: int, margin: float,
                 probe: bool) -> int:
    """This round's budget for one request: 1 instead of 0 on a probe round."""
    budget = best_budget(acceptance, costs, max_drafts, margin)
    return 1 if budget == 0 and probe else budget


def probe_interval(costs: StepCosts, probe_every: int, max_share: float) -> int:
    """Engine rounds between probes: at least `probe_every`, and far enough
    apart that a probe that finds nothing (a drafted round of one step: F + w
    plain steps more than a plain one) costs at most `max_share` of decoding."""
    return max(probe_every, math.ceil((costs.round_overhead + costs.per_draft) / max_share))


def batch_steps(acceptances: list[float], budgets: list[int], costs: StepCosts,
                batch_size: int, margin: float) -> int:
    """Draft steps for the whole batch. A step runs every row of the batch, so
    its cost (per batch step, from the nearest batch size timed) is paid once for all
    requests and k steps pay only when the drafting requests' extra tokens
    together beat it: the k with the most tokens per plain batch step,
    (B + sum_i (E_i(min(k, k_i)) - 1)) / (B (1 + F + k w)), and 0 unless it
    beats plain by `margin`. At batch 1 this is the request's own budget."""
    best, best_speed = 0, 1.0 + margin
    for steps in range(1, max(budgets, default=0) + 1):
        extra = sum(expected_tokens(acceptance, min(steps, budget)) - 1
                    for acceptance, budget in zip(acceptances, budgets) if budget > 0)
        cost = batch_size * (1.0 + costs.round_overhead + steps * costs.per_draft)
        speed = (batch_size + extra) / cost
        if speed > best_speed:
            best, best_speed = steps, speed
    return best


class RoundClock:
    """Wall seconds of the engine's rounds, per batch size (at most the
    scheduler's max_num_seqs keys, each a bounded window): plain rounds (the
    previous round verified nothing) and drafted ones (seconds from the start
    of a round that ran k draft steps to the start of the next, which verified
    them), and rounds that only looked up (seconds from the start of a round
    whose n drafts were all looked up to the start of the next, which verified
    them). Only steady rounds count: the same requests as the round before and
    no prefill tokens in the forward, so idle gaps and prompts never do. A plain
    time is the median of the plain rounds within `horizon` rounds of the
    newest at that batch size, so one timed again after a long run of drafting
    stands for today's context lengths; drafted and looked-up rounds count only
    within `horizon` rounds of that newest plain one (`_recent`), so a slow spell
    of the machine cannot stop drafting for good."""

    def __init__(self, window: int = 64, horizon: int = 512):
        self.window = window
        self.horizon = horizon
        self.plain: dict[int, deque[tuple[int, float]]] = {}  # (round, seconds)
        self.drafted: dict[int, deque[tuple[int, float]]] = {}  # (steps, seconds)
        self.looked_up: dict[int, deque[tuple[int, float]]] = {}  # (drafts, seconds)
        self.newest_plain_round = -1

    def record_plain(self, batch_size: int, seconds: float, round_index: int) -> None:
        self.plain.setdefault(batch_size, deque(maxlen=self.window)).append(
            (round_index, seconds))
        self.newest_plain_round = round_index

    def fresh_plain_rounds(self, now: int) -> int:
        """Plain rounds timed within the last `horizon` rounds (any batch size)."""
        return sum(1 for samples in self.plain.values()
                   for round_index, _ in samples if now - round_index < self.horizon)

    def record_drafted(self, batch_size: int, steps: int, seconds: float,
                       round_index: int = 0) -> None:
        self.drafted.setdefault(batch_size, deque(maxlen=self.window)).append(
            (round_index, steps, seconds))

    def record_looked_up(self, batch_size: int, drafts: int, seconds: float,
                         round_index: int = 0) -> None:
        self.looked_up.setdefault(batch_size, deque(maxlen=self.window)).append(
            (round_index, drafts, seconds))

    def _recent(self, samples, batch_size: int) -> list[tuple[int, float]]:
        """Drafted or looked-up rounds timed within `horizon` rounds of the
        newest plain round at `batch_size`, as (count, seconds): they age as
        plain ones do, so costs inflated by a slow spell of the machine expire
        even while they keep the engine from drafting (plain rounds are timed
        again at least every few hundred rounds)."""
        newest = self.plain[batch_size][-1][0]
        return [(count, seconds) for round_index, count, seconds in samples
                if newest - round_index < self.horizon]

    def plain_rounds(self) -> int:
        return sum(len(samples) for samples in self.plain.values())

    def plain_seconds(self, batch_size: int) -> float | None:
        """Median plain round at the nearest batch size measured."""
        key = _nearest(self.plain, batch_size)
        if key is None:
            return None
        newest = self.plain[key][-1][0]
        return statistics.median(seconds for round_index, seconds in self.plain[key]
                                 if newest - round_index < self.horizon)

    def plain_seconds_at(self, batch_size: int, min_samples: int = 1) -> float | None:
        """Median plain round at the nearest batch size in the same bucket
        (`batch_bucket`) with at least `min_samples` plain rounds timed; None
        where none is."""
        key = _nearest_in_bucket({size: samples for size, samples in self.plain.items()
                                  if len(samples) >= min_samples}, batch_size)
        return None if key is None else self.plain_seconds(key)

    def costs(self, prior: StepCosts | Callable[[int], StepCosts],
              min_samples: int = 3) -> dict[int, StepCosts]:
        """Costs per batch size with a plain time; the stand-in `prior`'s (one
        for all, or one per batch size) where too few drafted (or looked-up)
        rounds were timed."""
        prior_at = prior if callable(prior) else (lambda _: prior)
        return {batch_size: self._costs_at(batch_size, prior_at(batch_size), min_samples)
                for batch_size in self.plain}

    def _costs_at(self, batch_size: int, prior: StepCosts, min_samples: int) -> StepCosts:
        plain = self.plain_seconds(batch_size)
        costs = prior
        samples = self._recent(self.drafted.get(batch_size, ()), batch_size)
        if len(samples) >= min_samples:
            costs = fit_round_costs([steps for steps, _ in samples],
                                    [seconds / plain - 1.0 for _, seconds in samples], prior)
        samples = self._recent(self.looked_up.get(batch_size, ()), batch_size)
        if len(samples) >= min_samples:
            costs = fit_lookup_costs([drafts for drafts, _ in samples],
                                     [seconds / plain - 1.0 for _, seconds in samples], costs)
        return costs

    def samples(self) -> dict:
        """The timed rounds per batch size in seconds, for the benchmark."""
        return {"plain": {b: list(s) for b, s in self.plain.items()},
                **{kind: {b: [(count, seconds) for _, count, seconds in s]
                          for b, s in rounds.items()}
                   for kind, rounds in (("drafted", self.drafted),
                                        ("looked_up", self.looked_up))}}


# A drafted round's cost at each draft count is the mean of its rounds' extra
# without their slowest tenth (`without_pauses`): the mean, because what a
# round costs can vary from round to round (an early exit's depth: AdaDecode's
# one-draft rounds cost several times their median when they exit late) and
# throughput pays the mean; the slowest tenth dropped
# keeps a pause of the machine out of it.
SLOWEST_DROPPED = 0.1


def without_pauses(values: list, key: Callable[[Any], float] = float) -> list:
    """`values` without the slowest tenth by `key`, and without the slowest one
    once there are three: a pause of the machine (a descheduled worker, the
    first run of a shape) in the first few rounds timed would otherwise set
    drafting's cost for good, because costs that say drafting loses stop the
    rounds that would time it again (an underestimate is timed away by the
    drafting it lets run)."""
    dropped = max(int(len(values) * SLOWEST_DROPPED), 1 if len(values) >= 3 else 0)
    return sorted(values, key=key)[:len(values) - dropped]


def mean_without_slowest(values: list[float]) -> float:
    return float(np.mean(without_pauses(values)))


def _centres(counts: list[int], extra: list[float],
             centre: Callable[[list[float]], float]) -> dict[int, float]:
    """Each count's centre (median or mean) extra."""
    return {k: float(centre([e for c, e in zip(counts, extra) if c == k]))
            for k in set(counts)}


def _cost_line(counts: list[int], extra: list[float],
               centre: Callable[[list[float]], float]) -> tuple[float, float] | None:
    """Slope and intercept of the least-squares line through each count's
    centre extra, weighted by how often it came, with the intercept a cost
    (>= 0): where the free line's is negative (a round's fixed extra too small
    to time, the per-token cost growing with the count), the line through the
    origin. None with fewer than two counts."""
    centres = _centres(counts, extra, centre)
    if len(centres) < 2:
        return None
    x, y = np.array(list(centres), dtype=float), np.array(list(centres.values()))
    weights = np.array([counts.count(k) for k in centres], dtype=float)
    slope, intercept = np.polyfit(x, y, 1, w=np.sqrt(weights))
    if intercept < 0:
        slope, intercept = (weights * x * y).sum() / (weights * x * x).sum(), 0.0
    return float(slope), float(intercept)


def fit_round_costs(steps: list[int], extra: list[float], prior: StepCosts) -> StepCosts:
    """F and w from drafted rounds' extra cost over a plain step (in plain
    steps): a line through each draft count's mean (`mean_without_slowest`)
    when rounds drafted at least two different counts and it rises; otherwise
    (every round drafted the same k, or the line falls) the prior's w, the
    rest of the extra being F. The lookup costs stay the prior's."""
    line = _cost_line(steps, extra, mean_without_slowest)
    if line is not None and line[0] > 0:
        return dataclasses.replace(prior, per_draft=line[0], round_overhead=line[1])
    k, value = max(_centres(steps, extra, mean_without_slowest).items(),
                   key=lambda item: steps.count(item[0]))
    per_draft = min(prior.per_draft, max(value, 0.0) / k)
    return dataclasses.replace(prior, per_draft=per_draft,
                               round_overhead=max(value - k * per_draft, 0.0))


def fit_lookup_costs(drafts: list[int], extra: list[float], costs: StepCosts) -> StepCosts:
    """A looked-up token's cost and a lookup round's fixed extra from lookup
    rounds' extra over a plain step: the line through each draft count's
    median, when lookups of at least two lengths were timed and the line is a
    cost (it replaces the profiling-mode share, which is in forward time, not
    the engine's, and is noise where verifying one more token costs little);
    otherwise `costs` unchanged."""
    line = _cost_line(drafts, extra, np.median)
    if line is None or line[0] <= 0:
        return costs
    return dataclasses.replace(costs, per_verified=line[0], lookup_overhead=line[1])


@dataclass
class GoodputGate:
    """Whether the rounds that verify drafts pay, measured, per batch-size
    bucket (`batch_bucket`): the costs above are a model, and a model's error
    at a loaded batch (a verification's attention, the rejection sampler over
    the batch, a draft step over every row) can make it draft where drafting
    loses. Each timed round that verified drafts is scored by what throughput
    pays: its tokens (each request's sampled token plus its accepted drafts)
    per second of the round, over a plain round's at its batch size. A
    bucket's score is the sum of its last `window` rounds' tokens (in plain
    rounds' worth) over the sum of their seconds, without the slowest tenth
    of them by seconds per token (`without_pauses`: the plain rounds it is
    compared with are medians, so one pause of the machine must not count
    against drafting either). A bucket scored over `min_rounds` rounds below
    1 + `margin` is closed (drafting there must beat plain by the margin
    budgets ask for, so a bucket near 1 does not flip between drafting at a
    loss and not): its rounds draft nothing, except one in `reopen_interval`
    rounds, which drafts as decided and is scored too, so a bucket whose
    drafting turns profitable (texts, load) reopens."""

    window: int = 8
    min_rounds: int = 4
    margin: float = 0.05
    # Per bucket, the last rounds' (tokens in plain rounds' worth, seconds).
    scored: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)

    def record(self, batch_size: int, tokens: int, seconds: float,
               plain_seconds: float) -> None:
        """A round of `batch_size` requests that yielded `tokens` in `seconds`,
        where a plain round of that batch takes `plain_seconds`."""
        rounds = self.scored.setdefault(batch_bucket(batch_size), deque(maxlen=self.window))
        rounds.append((tokens / batch_size * plain_seconds, seconds))

    def ratios(self) -> dict[int, float]:
        """Each scored bucket's drafting rounds' throughput over plain's."""
        ratios = {}
        for bucket, rounds in self.scored.items():
            kept = without_pauses(list(rounds), key=lambda r: r[1] / max(r[0], 1e-12))
            seconds = sum(s for _, s in kept)
            if seconds > 0:
                ratios[bucket] = sum(worth for worth, _ in kept) / seconds
        return ratios

    def closed(self) -> dict[int, float]:
        """The buckets whose drafting does not pay, with their ratio."""
        return {bucket: ratio for bucket, ratio in self.ratios().items()
                if ratio < 1.0 + self.margin and len(self.scored[bucket]) >= self.min_rounds}


def reopen_interval(ratio: float, least: int, max_share: float) -> int:
    """Rounds between a closed bucket's tries: a try costs about 1 / ratio - 1
    plain rounds more than a plain round, so tries at this spacing cost at most
    `max_share` of decoding (and come at least `least` rounds apart)."""
    return max(least, math.ceil((1.0 / max(ratio, 1e-3) - 1.0) / max_share))


def batch_bucket(batch_size: int) -> int:
    """Batch sizes whose costs may stand for each other: 1, 2, 3-4, 5-8, ...
    Drafting's cost relative to a plain step changes with the batch (on a
    compute-bound CPU a batch-4 verification of 5 tokens each costs far more
    plain steps than a batch-1 one), so batch 1's costs must not decide at 4."""
    return (batch_size - 1).bit_length()


def costs_for(costs: dict[int, StepCosts], batch_size: int) -> StepCosts | None:
    """The costs measured at the batch size nearest `batch_size` within its
    bucket (`batch_bucket`); None when none was timed there."""
    key = _nearest_in_bucket(costs, batch_size)
    return None if key is None else costs[key]


def _nearest_in_bucket(sizes, batch_size: int) -> int | None:
    """The batch size of `sizes` nearest `batch_size` within its bucket."""
    return _nearest([size for size in sizes if batch_bucket(size) == batch_bucket(batch_size)],
                    batch_size)


def _nearest(sizes, batch_size: int) -> int | None:
    return min(sizes, key=lambda key: (abs(key - batch_size), key), default=None)
