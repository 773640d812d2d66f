"""The gate between a method's mechanism (a skip set, an early exit) and the
full-depth draft over the same weights, through its API on recorded numbers:
the base drafts until measured, the mechanism is tried and kept only where it
pays at the engine's costs, trials keep both records current."""

from __future__ import annotations

import pytest

from vllm_selfspec.policy.mechanism_gate import MechanismGate, RoundSources, SourceChoice
from vllm_selfspec.policy.payoff import StepCosts, expected_tokens

# SmolLM2-135M's int8 copy at batch 1 in plain steps: a full-depth draft token
# 0.45 (0.35 its draft step, 0.10 its verification share), 0.1 per round.
COSTS = StepCosts(per_draft=0.45, round_overhead=0.1, per_verified=0.10)
LENGTHS = (18, 12)  # the most drafts of a mechanism round, of a base round


def measured(gate: MechanismGate, mechanism: bool, acceptance: float, drafts: int = 4,
             rounds: int = 60) -> None:
    """`rounds` request-rounds of `drafts` drafts accepting `acceptance` of
    them (as whole rounds: accepted, then one rejected)."""
    for index in range(rounds):
        accepted = round(acceptance * drafts) if index % 2 else int(acceptance * drafts)
        gate.record(mechanism, drafts, accepted)


def choices(gate: MechanismGate, rounds: int, share: float, costs=COSTS) -> list:
    return [gate.next_round(costs, 1, LENGTHS, share) for _ in range(rounds)]


def test_the_base_drafts_alone_until_it_is_measured_then_the_mechanism_is_tried():
    gate = MechanismGate(trial_every=4)
    assert all(not c.mechanism and not c.trial for c in choices(gate, 8, 0.5))
    measured(gate, False, 0.9)
    picked = choices(gate, 8, 0.5)
    # Unmeasured, the mechanism drafts only in trials, one round in trial_every.
    assert [c.mechanism for c in picked] == [False, False, False, True] * 2
    assert all(c.trial == c.mechanism for c in picked)


def test_a_mechanism_accepted_far_less_loses_to_the_base_though_its_step_is_cheaper():
    """Qwen2.5-Coder-0.5B's figures: DEL's exits accepted 0.67 and SWIFT's sets
    0.52, where the full-depth int8 draft is accepted 0.93. Once both are
    measured, the loser is tried one round in retrial_every."""
    gate = MechanismGate(trial_every=4, retrial_every=16)
    measured(gate, False, 0.93, drafts=5)
    for mechanism_acceptance in (0.67, 0.52):
        measured(gate, True, mechanism_acceptance, drafts=3, rounds=200)
        ours, theirs = gate.speeds(COSTS, 1, LENGTHS, 0.6)
        assert ours < theirs
        picked = choices(gate, 32, 0.6)
        assert [c.mechanism for c in picked] == [c.trial for c in picked]
        assert sum(c.trial for c in picked) == 2


def test_a_mechanism_as_good_and_cheaper_wins_and_the_base_stays_tried():
    gate = MechanismGate(retrial_every=8)
    measured(gate, False, 0.9)
    measured(gate, True, 0.88)
    picked = choices(gate, 16, 0.5)
    assert [c.mechanism for c in picked if not c.trial] == [True] * 14
    assert [c.mechanism for c in picked if c.trial] == [False, False]


def test_the_speeds_are_tokens_per_plain_step_at_each_sources_length_and_step_cost():
    gate = MechanismGate()
    measured(gate, False, 0.75, drafts=4)
    measured(gate, True, 0.5, drafts=2)
    ours, theirs = gate.speeds(COSTS, 1, LENGTHS, 0.5)
    base_acceptance = gate.acceptance(False)  # reached: drafts up to the first rejection
    assert theirs == pytest.approx(expected_tokens(base_acceptance, 4)
                                   / (1.1 + 4 * (0.10 + 0.35)))
    assert ours == pytest.approx(expected_tokens(gate.acceptance(True), 2)
                                 / (1.1 + 2 * (0.10 + 0.5 * 0.35)))


def test_the_base_step_is_read_back_from_steps_the_mechanism_ran():
    """The engine times draft steps as they ran: where the mechanism ran them
    all at half the cost, the measured step is half the base's."""
    gate = MechanismGate()
    measured(gate, False, 0.75, drafts=4)
    measured(gate, True, 0.75, drafts=4)
    for _ in range(50):
        gate.record_steps(True, 4)
    half = StepCosts(per_draft=0.10 + 0.175, round_overhead=0.1, per_verified=0.10)
    _, theirs = gate.speeds(half, 1, LENGTHS, 0.5)
    assert theirs == pytest.approx(expected_tokens(gate.acceptance(False), 4)
                                   / (1.1 + 4 * (0.10 + 0.35)))


def test_not_cost_aware_the_mechanism_drafts_every_round_as_the_papers_do():
    gate = MechanismGate()
    measured(gate, False, 0.95)
    measured(gate, True, 0.3)
    assert all(c.mechanism and not c.trial
               for c in (gate.next_round(None, 1, LENGTHS, 0.5) for _ in range(40)))


def test_acceptance_counts_drafts_up_to_the_first_rejection():
    gate = MechanismGate(min_reached=1)
    gate.record(True, drafted=6, accepted=2)  # 3 reached: 2 accepted, then 1 rejected
    gate.record(True, drafted=2, accepted=2)  # both reached and accepted
    assert gate.acceptance(True) == pytest.approx((0.98 * 2 + 2) / (0.98 * 3 + 2))
    assert gate.round_length(True, 18) == 4
    assert gate.acceptance(False) is None and gate.round_length(False, 12) == 12


def test_bad_settings_are_refused():
    for bad in ({"trial_every": 1}, {"retrial_every": 0}, {"min_reached": 0},
                {"decay": 0.0}):
        with pytest.raises(ValueError):
            MechanismGate(**bad)


def test_a_requests_verified_drafts_teach_the_source_that_made_them_and_are_forgotten():
    """Each request's verification goes to the source of its own last
    self-drafting round (a round later for some), the base's stop moves on
    the base's own rounds only (not on its trials), and finished requests
    leave no state."""
    sources = RoundSources(gate=MechanismGate(trial_every=2))
    base = sources.choose(["a", "b"], COSTS, LENGTHS, 0.5)
    assert not base.mechanism and sources.by_request == {"a": base, "b": base}
    # The base's drafts: not the method's own feedback, to the base's record.
    assert sources.observe("a", 3, 4) is False
    assert sources.gate.base.drafted == 4 and sources.gate.mechanism.drafted == 0
    assert len(sources.base_stop) == 1
    assert sources.observe("unknown", 1, 2) is True  # no source: the method's
    measured(sources.gate, False, 0.9)
    trial = sources.choose(["b"], COSTS, LENGTHS, 0.5)
    assert trial.mechanism and trial.trial
    assert sources.by_request["a"] is base and sources.by_request["b"] is trial
    assert sources.observe("b", 1, 4) is True  # the mechanism's trial
    assert sources.gate.mechanism.drafted == 4
    # A trial of the base teaches the gate but not the base's stop.
    sources.by_request["c"] = SourceChoice(mechanism=False, trial=True)
    sources.observe("c", 2, 4)
    assert "c" not in sources.base_stop.requests
    sources.forget({"b"})
    assert set(sources.by_request) == {"b"}
    assert sources.per_request_state() == {"base_thresholds": 0, "request_sources": 1}


def test_a_round_the_mechanism_declines_is_the_bases_and_counted():
    """A trial whose method drafts nothing (DEL: no exit pays) falls back to
    the base: the requests' verification teaches the base's record and stop,
    the mechanism keeps no record, and the report counts the trial and the
    decline."""
    sources = RoundSources(gate=MechanismGate(trial_every=2))
    measured(sources.gate, False, 0.9)
    assert not sources.choose(["a"], COSTS, LENGTHS, 0.5).mechanism
    trial = sources.choose(["a"], COSTS, LENGTHS, 0.5)  # every 2nd round
    assert trial.mechanism and trial.trial
    fallen = sources.fall_back(["a"])
    assert not fallen.mechanism and not fallen.trial and sources.by_request["a"] is fallen
    base_drafted = sources.gate.base.drafted
    assert sources.observe("a", 3, 4) is False
    assert sources.gate.base.drafted == pytest.approx(0.98 * base_drafted + 4)
    assert sources.gate.mechanism.drafted == 0 and len(sources.base_stop) == 1
    report = sources.describe()
    assert report["mechanism_trials"] == 1 and report["declined_by_mechanism"] == 1
    assert report["mechanism_acceptance"] is None
