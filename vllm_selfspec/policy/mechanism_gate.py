"""Whether a method's own drafts pay against the full-depth draft they replace.

A skip set (Draft & Verify, SWIFT) or an early exit (DEL) runs fewer of the
draft's layers than the full-depth draft over the same weights (the cheap
base: the int8 copy, the draft vocabulary), so each of its draft steps is
cheaper, and its drafts are accepted less often. Each drafting round goes to
one of the two, the mechanism or the base, whichever yields more tokens per
plain step at the engine's costs:

    T = E(a, k)                   C = 1 + F + k * (v + d * S)

(E: expected tokens of a round of k chained drafts, `payoff.expected_tokens`;
a: the source's measured acceptance; k: its rounds' measured mean length; F:
a round's fixed extra, v: a draft's share of the verification, both in plain
steps as the engine times them; S: the full-depth draft step; d: the
mechanism's draft step over the base's, timed at start-up, 1 for the base.)
The mechanism drafts when its T / C beats the base's by cost-aware drafting's
margin (`MIN_GAIN`). The engine times draft steps as they run, whichever source
ran them, so S is read back from the measured step through the share of
steps each source ran.

Acceptances count the drafts a verification reached (the first rejected one
included), a moving average per source. Until the base has a record every
round is the base's; then one drafting round in `trial_every` goes to the
mechanism until it has a record too, and from then on one in `retrial_every`
to the source not chosen, so both records stay current (a trial of the
losing source costs that round's difference: few, once both are known). A trial round teaches the gate, not the requests' acceptance
records (`RoundPolicy.note_trials`). Inputs are verified tokens and the costs
rank 0 shares, alike on every tensor-parallel rank, so every rank chooses the
same source. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_selfspec.policy.confidence_stop import REFERENCE_RULE, ConfidenceStop
from vllm_selfspec.policy.payoff import StepCosts, expected_tokens
from vllm_selfspec.policy.rounds import MIN_GAIN


@dataclass(frozen=True)
class SourceChoice:
    """A drafting round's source: the method's mechanism or the full-depth
    base, and whether the round is a trial of it."""

    mechanism: bool
    trial: bool = False


@dataclass
class SourceRecord:
    """Decayed counts of one source's verified drafts and rounds."""

    reached: float = 0.0
    accepted: float = 0.0
    drafted: float = 0.0
    rounds: float = 0.0


@dataclass
class MechanismGate:
    decay: float = 0.98
    min_reached: float = 16.0
    trial_every: int = 16
    retrial_every: int = 64
    rounds: int = 0
    mechanism: SourceRecord = field(default_factory=SourceRecord)
    base: SourceRecord = field(default_factory=SourceRecord)
    # Decayed share of draft steps the mechanism ran (to read the base's step
    # back from the engine's measured one).
    mechanism_steps: float = 0.0
    steps: float = 0.0
    mechanism_trials: int = 0  # rounds offered to the mechanism as trials

    def __post_init__(self) -> None:
        if (self.min_reached <= 0 or min(self.trial_every, self.retrial_every) < 2
                or not 0.0 < self.decay <= 1.0):
            raise ValueError("MechanismGate: min_reached must be > 0, trial_every and "
                             "retrial_every >= 2 and decay in (0, 1]")

    def _source(self, mechanism: bool) -> SourceRecord:
        return self.mechanism if mechanism else self.base

    def record(self, mechanism: bool, drafted: int, accepted: int) -> None:
        """One request's verified round: `drafted` > 0 drafts by the source,
        the first `accepted` of them accepted."""
        if drafted <= 0:
            return
        source, w = self._source(mechanism), self.decay
        source.reached = w * source.reached + min(drafted, accepted + 1)
        source.accepted = w * source.accepted + accepted
        source.drafted = w * source.drafted + drafted
        source.rounds = w * source.rounds + 1.0

    def record_steps(self, mechanism: bool, steps: int) -> None:
        """A round's draft steps, by the source that ran them."""
        self.steps = self.decay * self.steps + steps
        self.mechanism_steps = self.decay * self.mechanism_steps + (steps if mechanism else 0)

    def acceptance(self, mechanism: bool) -> float | None:
        """A source's acceptance, once its drafts were reached often enough."""
        source = self._source(mechanism)
        if source.reached < self.min_reached:
            return None
        return source.accepted / source.reached

    def round_length(self, mechanism: bool, max_drafts: int) -> int:
        """A source's drafts per request-round as its rounds have run
        (`max_drafts` before any was recorded)."""
        source = self._source(mechanism)
        if source.rounds < 1.0:
            return max_drafts
        return min(max_drafts, max(1, round(source.drafted / source.rounds)))

    def speeds(self, costs: StepCosts, batch_size: int, max_drafts: tuple[int, int],
               step_share: float) -> tuple[float, float] | None:
        """Tokens per plain step of (the mechanism, the base) at these costs,
        for rounds of at most `max_drafts` (mechanism's, base's) drafts and a
        mechanism draft step costing `step_share` of the base's; None until
        both have a record."""
        ours, theirs = self.acceptance(True), self.acceptance(False)
        if ours is None or theirs is None:
            return None
        verified = batch_size * (costs.per_verified or 0.0)
        measured_step = max(0.0, costs.per_draft - verified)
        mixed = self.mechanism_steps / self.steps if self.steps > 0 else 0.0
        full_step = measured_step / max(1e-6, 1.0 - mixed * (1.0 - step_share))

        def speed(acceptance: float, drafts: int, share: float) -> float:
            cost = 1.0 + costs.round_overhead + drafts * (verified + share * full_step)
            return expected_tokens(acceptance, drafts) / cost

        return (speed(ours, self.round_length(True, max_drafts[0]), step_share),
                speed(theirs, self.round_length(False, max_drafts[1]), 1.0))

    def next_round(self, costs: StepCosts | None, batch_size: int,
                   max_drafts: tuple[int, int], step_share: float) -> SourceChoice:
        """The next drafting round's source (`costs` None: not cost-aware, the
        mechanism drafts every round, as the papers do)."""
        if costs is None:
            return SourceChoice(mechanism=True)
        self.rounds += 1
        if self.acceptance(False) is None:
            return SourceChoice(mechanism=False)  # the base drafts alone until measured
        speeds = self.speeds(costs, batch_size, max_drafts, step_share)
        chosen = speeds is not None and speeds[0] > (1.0 + MIN_GAIN) * speeds[1]
        if self.rounds % (self.trial_every if speeds is None else self.retrial_every) == 0:
            self.mechanism_trials += not chosen
            return SourceChoice(mechanism=not chosen, trial=True)
        return SourceChoice(mechanism=chosen)

    def describe(self) -> dict:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {"mechanism_acceptance": rounded(self.acceptance(True)),
                "base_acceptance": rounded(self.acceptance(False)),
                "mechanism_round_length": rounded(
                    self.mechanism.drafted / self.mechanism.rounds
                    if self.mechanism.rounds else None),
                "base_round_length": rounded(
                    self.base.drafted / self.base.rounds if self.base.rounds else None),
                "mechanism_share_of_steps": rounded(
                    self.mechanism_steps / self.steps if self.steps else None),
                "mechanism_trials": self.mechanism_trials}


@dataclass
class RoundSources:
    """A method with a mechanism over its full-depth base, per request: which
    source made each request's last self-drafts (vLLM may verify them a round
    later), the base's own confidence stop, and the gate they teach. Held for
    the requests vLLM holds only (`forget`)."""

    gate: MechanismGate = field(default_factory=MechanismGate)
    base_stop: ConfidenceStop = field(default_factory=lambda: ConfidenceStop(REFERENCE_RULE))
    by_request: dict[str, SourceChoice] = field(default_factory=dict)
    declined_by_mechanism: int = 0  # its rounds the base drafted (`fall_back`)

    def choose(self, req_ids: list[str], costs: StepCosts | None,
               max_drafts: tuple[int, int], step_share: float) -> SourceChoice:
        """This self-drafting round's source for `req_ids` (the gate's
        `next_round`), noted for each request's verification."""
        source = self.gate.next_round(costs, len(req_ids), max_drafts, step_share)
        self.by_request.update(dict.fromkeys(req_ids, source))
        return source

    def fall_back(self, req_ids: list[str]) -> SourceChoice:
        """The base drafts a round given to the mechanism whose own choice
        drafts nothing (DEL's exits where no exit pays for any of the
        requests): the round drafts as the base's would, not at all. Counted
        as declined by the mechanism."""
        self.declined_by_mechanism += 1
        source = SourceChoice(mechanism=False)
        self.by_request.update(dict.fromkeys(req_ids, source))
        return source

    def observe(self, req_id: str, accepted: int, drafted: int) -> bool:
        """A request's verified self-drafts: to the gate, by the source that
        made them, and to the base's stop on the base's own rounds (not its
        trials). Returns whether they are the mechanism's (or of no known
        source), so the method's own feedback takes them."""
        source = self.by_request.get(req_id)
        if source is None:
            return True
        self.gate.record(source.mechanism, drafted, accepted)
        if not source.mechanism and not source.trial:
            self.base_stop.observe(req_id, accepted, drafted)
        return source.mechanism

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the state of requests vLLM no longer holds."""
        self.base_stop.forget(live_req_ids)
        for req_id in set(self.by_request) - live_req_ids:
            del self.by_request[req_id]

    def per_request_state(self) -> dict[str, int]:
        return {"base_thresholds": len(self.base_stop), "request_sources": len(self.by_request)}

    def describe(self) -> dict:
        """The gate's report and the rounds the mechanism declined."""
        return {**self.gate.describe(), "declined_by_mechanism": self.declined_by_mechanism}
