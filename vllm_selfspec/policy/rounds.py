"""The round policy: per round, on host values alone, whether drafting pays
and how far (cost-aware drafting, `policy/payoff.py`), and what each
round teaches the next: acceptance records from the drafts the forward
verified, the round clock's timings, the goodput gate's scores, the costs
shared between tensor-parallel ranks.

The proposer (`proposers/base.py`) reads vLLM's runner and tensors and hands
the policy plain values: request ids in batch order, lists of ints and bools,
the requests vLLM holds, `time.perf_counter()` seconds. Nothing here imports
torch or vLLM: the one tensor-parallel collective (rank 0's costs, shared) is
a function the proposer gives (`share`), and so is the start-up timing that
round costs may have to run at first use (`time_forwards`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from vllm_selfspec.policy.payoff import (
    AcceptanceRecords,
    ForwardTimes,
    GoodputGate,
    MatchRecords,
    RoundClock,
    StepCosts,
    batch_bucket,
    batch_steps,
    costs_for,
    best_speed,
    estimated_draft,
    probe_interval,
    reopen_interval,
)

# Cost-aware drafting: the per-token acceptance assumed before the engine has
# verified any draft (afterwards a new request starts from the engine's own
# record of its drafts), the decay of a request's record per verified round,
# of the engine's (the long run), and of a request's per round it drafts
# nothing (so it drifts back to the engine's record and tries again), and the
# gain over plain decoding a budget must promise (a margin for the error of
# the cost and acceptance estimates). The decays were chosen by simulating
# requests of known acceptance against the costs measured here
# (docs/design.md, "Acceptance records").
PRIOR_ACCEPTANCE = 0.6
PAYOFF_DECAY = 0.9
ENGINE_PAYOFF_DECAY = 0.98
IDLE_DECAY = 0.95
# Lookup records decay faster (0.8 per verified round, the engine's too) and
# do not forget idle rounds: copying comes and goes within a request faster
# than a self-draft's payoff does.
LOOKUP_PAYOFF_DECAY = 0.8
# Looked-up drafts' acceptance is kept per match length up to this one
# (`MatchRecords`), for the engine, decaying as its self-drafts' record does.
LONGEST_MATCH_RECORD = 12
MIN_GAIN = 0.05
PROBE_SHARE = 0.01  # of decoding time, at most, spent on probes that find nothing
# Measured costs are shared from tensor-parallel rank 0 every SHARE_EVERY
# rounds. An engine first decodes PLAIN_ROUNDS_FIRST steady rounds plainly to
# time a plain step, and does so again (one round in SHARE_EVERY) whenever fewer
# than that were timed in the last REFRESH_ROUNDS rounds, as contexts grow; if
# no steady round comes for NOT_STEADY_ROUNDS rounds (a busy server whose batch
# changes every step), the stand-in costs from the start-up forward times
# (`ForwardTimes.prior_at`, per batch size) serve meanwhile.
SHARE_EVERY = 16
REFRESH_ROUNDS = 512
PLAIN_ROUNDS_FIRST = 3
NOT_STEADY_ROUNDS = 2 * SHARE_EVERY


@dataclass(frozen=True)
class RoundTiming:
    """The previous round: its requests, draft steps run, when its drafting
    started and ended, and whether any of its drafts were looked up."""

    req_ids: list[str]
    steps: int
    started: float
    ended: float
    looked_up: bool = False


@dataclass(frozen=True)
class DraftDecision:
    """A round that drafts: its draft steps, which requests draft, and each
    request's budget (None when not cost-aware: every step)."""

    steps: int
    may_draft: list[bool]
    budgets: list[int] | None


@dataclass
class DraftCounters:
    """Work done since the engine started, for the benchmark's tokens per
    loaded layer: target forwards (each runs every layer) and draft layers."""

    rounds: int = 0
    draft_steps: int = 0
    draft_layers: float = 0.0

    def add_step(self, layers: float) -> None:
        self.draft_steps += 1
        self.draft_layers += layers


@dataclass(frozen=True)
class RoundFeedback:
    """What the drafts the forward verified said: each verified request's
    accepted drafts, and (request, accepted, verified) for each verified
    request whose drafts were self-drafts (the method's own feedback,
    `SelfSpecProposer.observe_round`)."""

    accepted: dict[str, int]
    self_drafted: list[tuple[str, int, int]]


class RoundOptions(Protocol):
    """The method's options the policy reads, every round (an RPC may change
    them while serving: `diagnostics.py`, `set_option`)."""

    cost_aware: bool | None
    probe_every: int | None


def here(make: Callable[[], Any]) -> Any:
    """`share` without tensor parallelism: this process's own value."""
    return make()


class RoundPolicy:
    """Per round: the requests' acceptance records, the engine's timed
    rounds and the goodput gate, and from them the round's decision (how many
    draft steps, which requests draft, each one's budget; how far each
    request's lookup may go).

    `share(make)` returns rank 0's `make()` on every tensor-parallel rank (a
    collective: every rank calls it in the same rounds; `make` runs on rank 0
    only); `time_forwards()` times the profiling-mode forwards behind the
    stand-in costs (also a collective) when they were not timed at start-up;
    `max_drafts` is the method's num_speculative_tokens."""

    def __init__(self, options: RoundOptions, max_drafts: int,
                 time_forwards: Callable[[], ForwardTimes],
                 share: Callable[[Callable[[], Any]], Any] = here) -> None:
        self.options = options
        self.max_drafts = max_drafts
        self._time_forwards = time_forwards
        self._share = share
        self.counters = DraftCounters()
        # Acceptance records for cost_aware; a lookup draft says nothing of
        # the self-draft, and the other way round.
        self.self_records = AcceptanceRecords(PRIOR_ACCEPTANCE, PAYOFF_DECAY,
                                              ENGINE_PAYOFF_DECAY, IDLE_DECAY)
        self.lookup_records = AcceptanceRecords(PRIOR_ACCEPTANCE, LOOKUP_PAYOFF_DECAY,
                                                LOOKUP_PAYOFF_DECAY, idle_decay=1.0)
        self.match_records = MatchRecords(PRIOR_ACCEPTANCE, ENGINE_PAYOFF_DECAY,
                                          LONGEST_MATCH_RECORD)
        # Requests whose newest drafts were looked up, each with the length of
        # the match that found them (0: not known). A request vLLM leaves out
        # of a step keeps its drafts and their source until it is verified.
        self.looked_up: dict[str, int] = {}
        # Requests whose newest self-drafts were a method's trial (`note_trials`).
        self.trials: set[str] = set()
        self.clock = RoundClock()
        self._previous_round: RoundTiming | None = None
        self.forward_times: ForwardTimes | None = None  # profiling mode, at start-up
        self.shared_costs: dict[int, StepCosts] = {}  # per batch size, rank 0's
        # Whether drafting rounds pay, measured; rank 0's closed buckets, shared.
        # Rounds that self-drafted and rounds that only looked up are scored
        # apart: a lookup costs its verification alone, so where self-drafts
        # lose, lookups may still pay, and the other way round.
        self.gate = GoodputGate()
        self.lookup_gate = GoodputGate()
        self.shared_closed: dict[int, float] = {}
        self.shared_lookup_closed: dict[int, float] = {}
        self._costs_of_round: tuple[int, StepCosts | None | bool] | None = None  # (round, costs)
        # Costs fixed from outside (`pin_costs`): they stand in for the timed
        # ones and the goodput gates.
        self.pinned_costs: StepCosts | None = None
        self._held_requests = 0  # requests vLLM held when state was last pruned
        self._quiet_until = 0  # rounds before this one may repeat the last decline

    def per_request_state(self) -> dict[str, int]:
        """Requests with state held now, per kind of state."""
        return {"self_records": len(self.self_records.requests),
                "lookup_records": len(self.lookup_records.requests),
                "looked_up": len(self.looked_up), "trials": len(self.trials)}

    def prior_at(self, batch_size: int) -> StepCosts:
        """The stand-in costs at `batch_size` (`ForwardTimes.prior_at`)."""
        return self.forward_times.prior_at(batch_size, self.max_drafts)

    # --- a round, in the order the proposer calls these ---------------------
    def repeat_decline(self, req_ids: list[str], held: Collection[str],
                       num_tokens: int) -> bool:
        """Decline again without deciding, in a round `decide` showed must
        decline as the one before did: the same requests, each decoding one
        token, nothing verified (so only the records' idle forgetting moved,
        whose retry waits for the next decision), and before the next probe or
        cost update. Deciding touches a few hundred Python
        objects, each a cache miss after the forward streamed the weights;
        this touches a few. `held`: the requests vLLM
        holds (its runner's)."""
        previous = self._previous_round
        if (previous is None or self.counters.rounds + 1 >= self._quiet_until
                or num_tokens != len(previous.req_ids)
                or not self._same_requests(req_ids, held)
                or self._lookup_try(len(req_ids), self.counters.rounds + 1)):
            return False
        started = time.perf_counter()
        self._time_previous_round(previous.req_ids, None, num_tokens, started)
        self.counters.rounds += 1
        self._previous_round = RoundTiming(previous.req_ids, 0, started, time.perf_counter())
        return True

    def _same_requests(self, req_ids: list[str], held: Collection[str]) -> bool:
        """The previous round's batch, and vLLM holds as many requests as when
        finished requests' state was last dropped."""
        previous = self._previous_round
        return (previous is not None and previous.req_ids == req_ids
                and len(held) == self._held_requests)

    def start_round(self, req_ids: list[str], held: Collection[str],
                    verified: list[int] | None, num_tokens: int,
                    started: float) -> set[str] | None:
        """Time the round that just ended, drop the state of requests vLLM no
        longer holds (looked at only when the batch or the held set changed),
        and count this round. `verified`: the drafts the forward that just ran
        verified per request (None: none), `num_tokens` the tokens in it.
        Returns the requests vLLM holds when state was dropped (so the method
        drops its own), else None."""
        self._time_previous_round(req_ids, verified, num_tokens, started)
        live = None
        if not self._same_requests(req_ids, held):
            live = set(held)
            self.self_records.forget(live)
            self.lookup_records.forget(live)
            self.looked_up = {req_id: match for req_id, match in self.looked_up.items()
                              if req_id in live}
            self.trials &= live
            self._held_requests = len(live)
        self.counters.rounds += 1
        return live

    def take_feedback(self, req_ids: list[str], verified: list[int] | None,
                      rejected: list[int] | None, num_tokens: int,
                      started: float) -> RoundFeedback:
        """Acceptance records from the drafts the forward verified (`rejected`:
        vLLM's rejected drafts per request), and the goodput gate's score of
        the round that just ended."""
        accepted_now: dict[str, int] = {}
        self_drafted: list[tuple[str, int, int]] = []
        if rejected is not None and verified is not None:
            # The engine's, self-drafts and lookups apart: accepted, rejections.
            round_counts = {False: [0, 0], True: [0, 0]}  # by looked_up
            for req_id, accepted, scheduled in verified_feedback(req_ids, verified, rejected):
                accepted_now[req_id] = accepted
                looked_up = req_id in self.looked_up
                if not looked_up:
                    self_drafted.append((req_id, accepted, scheduled))
                    if req_id in self.trials:
                        continue  # it teaches the method, not what its drafts accept
                records = self.lookup_records if looked_up else self.self_records
                if looked_up and self.looked_up[req_id]:
                    self.match_records.add(self.looked_up[req_id], accepted, scheduled)
                records.add_request_round(req_id, accepted, scheduled, self.counters.rounds)
                counts = round_counts[looked_up]
                counts[0] += accepted
                counts[1] += int(accepted < scheduled)
            self.self_records.add_engine_round(*round_counts[False])
            self.lookup_records.add_engine_round(*round_counts[True])
        self.trials.difference_update(req_ids)
        self._score_previous_round(req_ids, verified, num_tokens, started, accepted_now)
        return RoundFeedback(accepted_now, self_drafted)

    def lookup_lengths(self, req_ids: list[str], costs: StepCosts | Literal[False],
                       max_tokens: int, source_sizes_drafts: bool = False) -> list[int]:
        """The most tokens each request's lookup may draft this round: when
        cost-aware, the length its own lookups' acceptance record makes worth
        their verification (a looked-up token runs no draft step, so in text
        that copies long spans this grows to `max_tokens`, and in text whose
        matches soon part from the target's it stays short), 0 where no
        length pays (that request then self-drafts or not, as decided for
        it), and 1 instead of 0 on a probe round, so the record recovers.
        With `source_sizes_drafts` (a source that estimates each draft's
        chance itself, as suffix trees do from how often a continuation
        followed the match), `max_tokens`: each draft is cut afterwards by
        its own estimate (`source_draft_length`). Without cost-aware
        drafting, `max_tokens`."""
        if costs is False or source_sizes_drafts:
            return [max_tokens] * len(req_ids)
        lookup_costs = costs.for_lookup(len(req_ids))
        probe = self.counters.rounds % probe_interval(
            lookup_costs, self.options.probe_every, PROBE_SHARE) == 0
        budgets, _ = self.lookup_records.budgets(
            req_ids, lookup_costs, max_tokens, MIN_GAIN, probe, self.counters.rounds)
        return budgets

    def source_draft_length(self, req_id: str, path_probabilities: list[float],
                            match_length: int, batch_size: int,
                            costs: StepCosts | Literal[False],
                            self_costs: StepCosts | None | bool) -> int:
        """How much of a looked-up draft whose source estimated each prefix's
        chance of acceptance pays at this round's lookup costs
        (`estimated_draft`, the estimate held to what drafts found by matches
        of `match_length` accept: `MatchRecords.calibrated`; all of it when
        not cost-aware), and 0 where, alone
        in the batch, the request's own self-draft promises more tokens per
        plain step at `self_costs` (this round's `timed_costs`) and its
        acceptance: then it self-drafts, as if nothing was found. At batch 1
        both are that request's speed in the same plain steps; in a batch a
        draft step is paid once for every row (`batch_steps`), which a lookup
        avoids, so there a lookup that pays stands."""
        if costs is False:
            return len(path_probabilities)
        length, speed = estimated_draft(
            self.match_records.calibrated(path_probabilities, match_length),
            costs.for_lookup(batch_size), MIN_GAIN)
        if length and batch_size == 1 and self_costs:
            acceptance = self.self_records.acceptances([req_id], self.counters.rounds)[0]
            if best_speed(acceptance, self_costs, self.max_drafts) >= speed:
                return 0
        return length

    def note_lookups(self, req_ids: list[str], looked_up: dict[str, int]) -> None:
        """Which of this round's requests drafted by lookup, each with the
        length of the match that found its draft (0 where the source does not
        say), whose record its feedback joins. A request vLLM
        leaves out of a step (the token budget) keeps its drafts for a later
        one, so its note stays until it is in a round again: its feedback
        then goes to the record of the drafts it had."""
        for req_id in req_ids:
            self.looked_up.pop(req_id, None)
        self.looked_up.update(looked_up)

    def note_trials(self, req_ids: list[str]) -> None:
        """This round's self-drafts of these requests are a method's trial, not
        how it drafts steadily (AdaDecode's probe of heads it has closed, or of
        heads not yet measured): their outcome reaches the method
        (`observe_round`) but not the acceptance records that decide whether
        and how far the requests draft, which would take a trial's rejections
        for the method's own. The note lasts until the request's next round."""
        self.trials.update(req_ids)

    def decide(self, req_ids: list[str], num_speculative_tokens: int,
               may_draft: list[bool]) -> DraftDecision | None:
        """How many draft steps this round runs and which requests draft, on
        host lists alone (a round that drafts nothing does no device work);
        None when it drafts nothing."""
        self._quiet_until = 0
        costs = self.timed_costs(len(req_ids))
        if costs is None:
            return None
        steps, budgets, all_may_draft = num_speculative_tokens, None, all(may_draft)
        if costs is not False:
            rounds = self.counters.rounds
            interval = probe_interval(costs, self.options.probe_every, PROBE_SHARE)
            probe = rounds % interval == 0
            budgets, acceptances = self.self_records.budgets(
                req_ids, costs, num_speculative_tokens, MIN_GAIN, probe, rounds)
            budgets = [b if row_drafts else 0 for b, row_drafts in zip(budgets, may_draft)]
            may_draft = [b > 0 for b in budgets]
            steps = batch_steps(acceptances, budgets, costs, len(req_ids), MIN_GAIN)
            if probe and any(budgets):
                steps = max(steps, 1)  # idle requests probe even where the batch would not
            if steps == 0 and all_may_draft and self.shared_costs and rounds % SHARE_EVERY:
                # Until the next probe or cost update, the same requests without
                # feedback decline again (`repeat_decline`); only their records'
                # idle forgetting moves meanwhile, so a retry waits for that round.
                self._quiet_until = min((rounds // interval + 1) * interval,
                                        (rounds // SHARE_EVERY + 1) * SHARE_EVERY)
        if steps == 0 or not any(may_draft):
            return None
        return DraftDecision(steps, may_draft, budgets)

    def end_round(self, req_ids: list[str], steps: int, started: float, ended: float,
                  looked_up: bool = False) -> None:
        """The round that ran (`RoundTiming`), timed and scored when the next
        one starts."""
        self._previous_round = RoundTiming(req_ids, steps, started, ended, looked_up)

    def skip_round(self, req_ids: list[str]) -> None:
        """A step whose drafter vLLM did not run: no request drafted, by
        lookup either, and no round is timed across it, nor repeats a decline
        across it: the next round decides."""
        self._previous_round = None
        self._quiet_until = 0
        self.note_lookups(req_ids, {})
        self.trials.difference_update(req_ids)

    # --- costs -----------------------------------------------------------------
    def timed_costs(self, batch_size: int) -> StepCosts | None | bool:
        """This round's costs for self-drafts when cost-aware (None: it
        self-drafts nothing: a plain step to time, or a batch size where
        self-drafting rounds were measured not to pay), False when not
        cost-aware."""
        return self._gated_costs(batch_size, lookups=False)

    def lookup_costs(self, batch_size: int) -> StepCosts | None | bool:
        """`timed_costs` for lookups: None where rounds that only looked up
        were measured not to pay (or a plain step is to be timed), whatever
        self-drafts do at this batch size."""
        return self._gated_costs(batch_size, lookups=True)

    def pin_costs(self, costs: StepCosts | None) -> None:
        """Decide every round by `costs` (None: by the engine's timings again),
        whatever the rounds measure and the goodput gates say: how cost-aware
        drafting chooses at given costs, alike on any machine (the tests'
        engines, what-if benchmarks). Each tensor-parallel rank must be given
        the same costs (`collective_rpc` does)."""
        self.pinned_costs = costs
        self._costs_of_round = None
        self._quiet_until = 0

    def _gated_costs(self, batch_size: int, lookups: bool) -> StepCosts | None | bool:
        if not self.options.cost_aware:
            return False
        if self.pinned_costs is not None:
            return self.pinned_costs
        # Once per round: sharing the costs is a tensor-parallel collective.
        if self._costs_of_round is None or self._costs_of_round[0] != self.counters.rounds:
            self._costs_of_round = (self.counters.rounds, self._round_costs(batch_size))
        costs = self._costs_of_round[1]
        if costs is None or self.closed(batch_size, self.counters.rounds, lookups):
            return None
        return costs

    def _round_costs(self, batch_size: int) -> StepCosts | None:
        """This round's costs from the engine's timed rounds, the same on every
        tensor-parallel rank (rank 0's, shared on the round clock); None when
        this round should draft nothing to time a plain step (none timed yet,
        none at a batch size of this one's bucket, or the newest is old).
        Whether the goodput gates closed its batch size is asked apart
        (`closed`)."""
        rounds = self.counters.rounds
        if self.forward_times is None:  # not timed at start-up (e.g. cost_aware switched on)
            self.forward_times = self._time_forwards()
        # Which rounds share, and the clock's keys and round indices, are alike
        # on every rank; only rank 0's timings are used.
        ready = self.clock.plain_rounds() >= PLAIN_ROUNDS_FIRST
        if ready and (rounds % SHARE_EVERY == 0 or not self.shared_costs):
            self.shared_costs, self.shared_closed, self.shared_lookup_closed = self._share(
                lambda: (self.clock.costs(self.prior_at), self.gate.closed(),
                         self.lookup_gate.closed()))
        if not self.shared_costs:
            return self.prior_at(batch_size) if rounds >= NOT_STEADY_ROUNDS else None
        if (rounds % SHARE_EVERY == 1
                and self.clock.fresh_plain_rounds(rounds) < PLAIN_ROUNDS_FIRST):
            return None  # the newest plain times are stale
        return costs_for(self.shared_costs, batch_size)

    def closed(self, batch_size: int, rounds: int, lookups: bool = False) -> bool:
        """Round `rounds` self-drafts nothing (with `lookups`: looks nothing
        up): cost-aware, its batch's bucket is closed (such rounds were not
        measured to beat plain ones by the gate's margin) and this is not one
        of the bucket's tries (`reopen_interval`); never with pinned costs."""
        closed = self.shared_lookup_closed if lookups else self.shared_closed
        ratio = closed.get(batch_bucket(batch_size))
        return (bool(self.options.cost_aware) and self.pinned_costs is None
                and ratio is not None
                and rounds % reopen_interval(ratio, self.options.probe_every,
                                             PROBE_SHARE) != 0)

    def _lookup_try(self, batch_size: int, rounds: int) -> bool:
        """Round `rounds` is a try of a bucket closed to lookups (it must
        decide: lookups may draft in it)."""
        return (self.pinned_costs is None
                and batch_bucket(batch_size) in self.shared_lookup_closed
                and not self.closed(batch_size, rounds, lookups=True))

    def next_round_closed(self, batch_size: int, lookups: bool = False) -> bool:
        """`closed` for the round about to start."""
        return self.closed(batch_size, self.counters.rounds + 1, lookups)

    # --- what the engine and its diagnostics read ---------------------------------
    @property
    def round_index(self) -> int:
        """The rounds (target forwards) counted so far: the current round's index."""
        return self.counters.rounds

    def add_draft_step(self, layers: float) -> None:
        """A draft step ran through `layers` of the target's layers."""
        self.counters.add_step(layers)

    def work_done(self) -> dict[str, float]:
        """Rounds, draft steps and draft layers run so far."""
        return vars(self.counters).copy()

    def plain_seconds(self, batch_size: int) -> float | None:
        """A plain round's seconds at the nearest batch size timed (median)."""
        return self.clock.plain_seconds(batch_size)

    def was_looked_up(self, req_id: str) -> bool:
        """Whether the request's newest drafts were looked up."""
        return req_id in self.looked_up

    def goodput(self) -> dict[str, dict[str, dict[int, float]]]:
        """Per kind of round (self-drafting, lookup-only): each batch
        bucket's measured throughput over plain's, and the buckets closed."""
        return {"self_drafts": {"ratios": self.gate.ratios(), "closed": self.shared_closed},
                "lookups": {"ratios": self.lookup_gate.ratios(),
                            "closed": self.shared_lookup_closed}}

    def timings(self) -> dict:
        """The timed rounds per kind and batch size, the costs shared now
        (per batch size, in plain steps), the goodput gates' report and
        looked-up drafts' acceptance by match length."""
        return {**self.clock.samples(),
                "shared": {size: vars(costs) for size, costs in self.shared_costs.items()},
                "goodput": self.goodput(),
                "lookup_acceptance_by_match_length": self.match_records.describe()}

    # --- what the round that just ended measured ------------------------------
    def _score_previous_round(self, req_ids: list[str], verified: list[int] | None,
                              num_tokens: int, started: float,
                              accepted_now: dict[str, int]) -> None:
        """Score the round that just ended in the goodput gate, if it verified
        drafts and was steady (the same requests as the one before, no prefill
        in the forward) and plain rounds of its bucket are timed: from the start
        of its drafting to now, it yielded each request's token and the drafts
        accepted."""
        previous = self._steady_previous_round(req_ids, verified, num_tokens)
        if previous is None or not sum(verified or ()):
            return
        # Against a median of several plain rounds: one slow plain round (a new
        # shape's first run, a pause of the machine) would score this bucket's
        # drafting many times faster than plain and keep it open at a loss.
        plain = self.clock.plain_seconds_at(len(req_ids), min_samples=PLAIN_ROUNDS_FIRST)
        if plain is not None:
            # A round that self-drafted at all is the self-drafts' (with its
            # lookups, if any: they ran beside them); one that only looked up,
            # the lookups'.
            gate = self.lookup_gate if previous.looked_up and previous.steps == 0 else self.gate
            gate.record(len(req_ids), len(req_ids) + sum(accepted_now.values()),
                        started - previous.started, plain)

    def _steady_previous_round(self, req_ids: list[str], verified: list[int] | None,
                               num_tokens: int) -> RoundTiming | None:
        """The round that just ended, if it was steady: the same requests as
        the one before, and a forward of one token per request plus the
        drafts it verified (no prefill)."""
        previous = self._previous_round
        if (previous is None or previous.req_ids != req_ids
                or num_tokens != len(req_ids) + sum(verified or ())):
            return None
        return previous

    def _time_previous_round(self, req_ids: list[str], verified: list[int] | None,
                             num_tokens: int, started: float) -> None:
        """Time the round that just ended into the clock, if it was steady."""
        previous = self._steady_previous_round(req_ids, verified, num_tokens)
        if previous is None:
            return
        drafts_verified = sum(verified or ())
        if drafts_verified > 0 and previous.looked_up and previous.steps == 0:
            self.clock.record_looked_up(len(req_ids), drafts_verified, started - previous.started,
                                        self.counters.rounds)
        elif drafts_verified > 0 and previous.steps > 0 and not previous.looked_up:
            # (A round whose drafts all stopped before step 1 verified nothing;
            # a round that both looked up and self-drafted is timed as neither.)
            self.clock.record_drafted(len(req_ids), previous.steps, started - previous.started,
                                      self.counters.rounds)
        elif drafts_verified == 0:
            self.clock.record_plain(len(req_ids), started - previous.ended,
                                    self.counters.rounds)


def verified_feedback(req_ids: list[str], verified: list[int], rejected: list[int]
                      ) -> list[tuple[str, int, int]]:
    """(request, accepted, verified) for each request that had drafts verified
    in the forward that just ran: vLLM reports 0 rejected for a request whose
    drafts it did not schedule, which must not count as accepted."""
    return [(req_id, max(scheduled - num_rejected, 0), scheduled)
            for req_id, scheduled, num_rejected in zip(req_ids, verified, rejected)
            if scheduled > 0]
