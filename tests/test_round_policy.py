"""The round policy through its API, engine-free: what each round drafts from
acceptance records and timed costs, the feedback a round's outcome gives, the
goodput gate and the probes, on recorded or stated timings."""

from __future__ import annotations

import copy
import subprocess
import sys
from types import SimpleNamespace
from typing import NoReturn

import pytest

from vllm_selfspec.assets import ROOT
from vllm_selfspec.policy.rounds import RoundPolicy, here, verified_feedback


# A start-up's forward times, recorded on the 2-core AVX2 CPU (SmolLM2-135M,
# float32; int8 draft with the draft vocabulary): a forward over 4 tokens costs
# what one over 1 does, one over 208 eight times as much.
RECORDED_FORWARD_TIMES = dict(tokens=(1, 4, 16, 64, 208),
                              target_seconds=(0.1179, 0.1043, 0.1581, 0.3354, 0.9510),
                              batch_sizes=(1, 4, 16),
                              draft_seconds=(0.0336, 0.0380, 0.0500))


def round_policy(probe_every: int = 16, share=here) -> RoundPolicy:
    """A cost-aware round policy whose forwards were not timed (a test that
    needs stand-in costs gives `forward_times`)."""
    def untimed() -> NoReturn:
        raise AssertionError("the policy timed forwards: give it forward_times")

    return RoundPolicy(SimpleNamespace(cost_aware=True, probe_every=probe_every),
                       max_drafts=4, time_forwards=untimed, share=share)


def heavy_imports(module: str) -> str:
    """Which of torch and vLLM importing `module` loads, in a fresh interpreter."""
    code = (f"import sys; before = set(sys.modules); import {module}; print(sorted("
            "{name.split('.')[0] for name in set(sys.modules) - before} & {'torch', 'vllm'}))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.splitlines()[-1]


def test_the_policy_loads_without_torch_or_vllm():
    """The policy is host logic: importing any of its modules, and all they
    import, loads neither torch nor vLLM (a module that does is seen doing so)."""
    modules = sorted(path.stem for path in (ROOT / "vllm_selfspec" / "policy").glob("*.py")
                     if path.stem != "__init__")
    assert {"rounds", "payoff", "skip_search", "exit_stats"} <= set(modules)
    for module in modules:
        assert heavy_imports(f"vllm_selfspec.policy.{module}") == "[]", module
    assert heavy_imports("vllm_selfspec.draft.tokens") == "['torch']"


def test_a_round_drops_the_state_of_requests_vllm_no_longer_holds():
    """A round whose batch or held requests changed drops the records and
    lookup notes of requests vLLM no longer holds, and names the requests it
    holds (the method drops its own state by them); a preempted request
    (held, out of the batch) keeps its record. A round of the same batch
    and held requests as the one before looks at nothing."""
    policy = round_policy()
    batch = ["a", "b", "c"]
    policy.note_lookups(batch, {"c": 0})
    policy.take_feedback(batch, [2, 2, 2], [0, 1, 2], num_tokens=9, started=0.0)
    assert set(policy.self_records.requests) == {"a", "b"}
    assert set(policy.lookup_records.requests) == {"c"}
    assert policy.start_round(batch, set(batch), None, 3, 0.0) == set(batch)  # the first
    policy.end_round(batch, 0, 0.0, 0.001)
    assert policy.start_round(batch, set(batch), None, 3, 0.01) is None  # nothing changed
    policy.end_round(batch, 0, 0.01, 0.011)
    # "b" preempted, "c" finished: the batch changed.
    assert policy.start_round(["a"], {"a", "b"}, None, 1, 0.02) == {"a", "b"}
    assert set(policy.self_records.requests) == {"a", "b"}
    assert policy.lookup_records.requests == {} and policy.looked_up == {}
    policy.end_round(["a"], 0, 0.02, 0.021)
    # The same batch, but "b" finished while out of it.
    assert policy.start_round(["a"], {"a"}, None, 1, 0.03) == {"a"}
    assert set(policy.self_records.requests) == {"a"}
    assert policy.per_request_state() == {"self_records": 1, "lookup_records": 0,
                                          "looked_up": 0, "trials": 0}
    assert policy.counters.rounds == 4


def test_a_trial_round_teaches_the_method_but_not_the_acceptance_records():
    """A method's trial drafts (AdaDecode probing its closed heads) reach the
    method's feedback but neither the request's acceptance record nor the
    engine's; the request's next round counts again, and a trial note of a
    request vLLM no longer holds is dropped."""
    policy, b_alone = round_policy(), round_policy()
    batch = ["a", "b"]
    for records in (policy, b_alone):
        records.take_feedback(batch, [4, 4], [0, 0], num_tokens=10, started=0.0)
    before = {req: copy.copy(policy.self_records.requests[req]) for req in batch}
    engine_before = copy.copy(policy.self_records.engine)
    policy.note_trials(["a"])
    feedback = policy.take_feedback(batch, [4, 4], [4, 4], num_tokens=10, started=0.1)
    b_alone.take_feedback(batch, [0, 4], [0, 4], num_tokens=10, started=0.1)
    assert [req for req, *_ in feedback.self_drafted] == batch  # both reach the method
    assert policy.self_records.requests["a"] == before["a"]  # the trial: unmoved
    assert policy.self_records.requests["b"] != before["b"]
    # The engine's record took b's rejections and nothing of a's.
    assert policy.self_records.engine == b_alone.self_records.engine != engine_before
    assert policy.trials == set()
    policy.take_feedback(batch, [4, 4], [4, 4], num_tokens=10, started=0.2)
    assert policy.self_records.requests["a"] != before["a"]  # the next round counts
    policy.note_trials(["a", "b"])
    policy.start_round(["a"], {"a"}, None, 1, 0.3)
    assert policy.trials == {"a"}


def test_feedback_counts_only_verified_drafts():
    """Request a drafted 4 but vLLM scheduled none (prefill chunk, budget):
    it reports 0 rejected, which is no feedback, not 4 accepted. Request b had
    2 of its drafts scheduled and 1 rejected."""
    feedback = verified_feedback(["a", "b", "c"], verified=[0, 2, 3], rejected=[0, 1, 3])
    assert feedback == [("b", 1, 2), ("c", 0, 3)]


def test_draft_budget_declines_when_drafting_loses_and_probes_again():
    from vllm_selfspec.policy.payoff import (
        DraftPayoff,
        StepCosts,
        best_budget,
        expected_tokens,
        round_budget,
    )

    assert expected_tokens(0.5, 2) == 1.75
    cheap, dear = StepCosts(per_draft=0.35), StepCosts(per_draft=1.05)
    assert best_budget(0.9, cheap, 8, 0.05) >= 4   # cheap and accepted: draft long
    assert best_budget(0.9, dear, 8, 0.05) == 0    # a draft step as dear as a plain one
    assert best_budget(0.2, cheap, 8, 0.05) == 0   # cheap but mostly rejected
    # A round's fixed cost makes single drafts lose and long ones win.
    fixed = StepCosts(per_draft=0.1, round_overhead=0.4)
    assert best_budget(0.4, fixed, 8, 0.05) == 0
    assert best_budget(0.4, StepCosts(per_draft=0.1), 8, 0.05) > 0
    assert best_budget(0.95, fixed, 8, 0.05) == 8
    payoff = DraftPayoff()
    for _ in range(10):  # every round rejected at once
        payoff.update(accepted=0, verified=2, decay=0.8)
    assert round_budget(payoff.acceptance(0.6), cheap, 8, 0.05, probe=False) == 0  # declines
    assert round_budget(payoff.acceptance(0.6), cheap, 8, 0.05, probe=True) == 1   # probes
    for _ in range(10):  # the text turned predictable: every draft accepted
        payoff.update(accepted=4, verified=4, decay=0.8)
    assert round_budget(payoff.acceptance(0.6), cheap, 8, 0.05, probe=False) >= 4


def test_a_request_stopped_by_a_few_rejections_tries_again():
    """Two rejections in a row are the counts' noise as often as the text: a
    request's record forgets in the rounds it drafts nothing, so it drifts
    back to the engine's record and drafts again (not only on probes), while
    where the engine's own record says no, nobody drafts off probes."""
    from vllm_selfspec.policy.payoff import AcceptanceRecords, StepCosts
    from vllm_selfspec.policy.rounds import (
        ENGINE_PAYOFF_DECAY,
        IDLE_DECAY,
        PAYOFF_DECAY,
    )

    costs = StepCosts(per_draft=0.6)
    good = AcceptanceRecords(0.6, PAYOFF_DECAY, ENGINE_PAYOFF_DECAY, IDLE_DECAY)
    for _ in range(40):  # the engine's self-drafts: 9 in 10 accepted
        good.add_engine_round(9, 1)
    assert good.budgets(["new"], costs, 12, 0.05, False, 41)[0] != [0]
    good.add_request_round("unlucky", 0, 3, 41)  # drafted in round 40, all rejected
    good.add_request_round("unlucky", 0, 2, 42)  # and in round 41

    def first_draft(records: AcceptanceRecords, rounds: range) -> int | None:
        return next((now for now in rounds
                     if records.budgets(["unlucky"], costs, 12, 0.05, False, now)[0][0]),
                    None)

    retry = first_draft(good, range(42, 200))
    assert retry is not None and 45 < retry < 42 + 60  # before its next probe
    assert good.requests["unlucky"].last_round == retry  # it drafts from here
    bad = AcceptanceRecords(0.6, PAYOFF_DECAY, ENGINE_PAYOFF_DECAY, IDLE_DECAY)
    for _ in range(40):  # the engine's self-drafts: 1 in 10 accepted
        bad.add_engine_round(1, 1)
    bad.add_request_round("unlucky", 0, 2, 42)
    assert first_draft(bad, range(42, 1000)) is None


def test_lookup_length_follows_the_requests_own_lookups():
    """A looked-up token costs only its verification: a request whose lookups
    keep being accepted looks up to the cap, one whose lookups part from the
    target at once looks up nothing but one token on probe rounds, each
    request by its own record; the self-draft's record is left alone. Without
    cost-aware drafting, or where the source sizes its own drafts (each draft
    is then cut by its own estimate), every lookup may run to the cap, whatever
    the request's record says."""
    from vllm_selfspec.policy.payoff import DraftPayoff, StepCosts
    from vllm_selfspec.policy.rounds import ENGINE_PAYOFF_DECAY

    policy = round_policy(probe_every=16)
    policy.counters.rounds = 1  # not a probe round
    # The self-draft's step is dear; verifying one more token is not.
    costs = StepCosts(per_draft=0.8, round_overhead=0.3, per_verified=0.04)
    first = policy.lookup_lengths(["copy", "chat"], costs, 12)
    assert first[0] == first[1] and 1 < first[0] < 12  # the prior, for both
    for _ in range(8):
        policy.note_lookups(["copy", "chat", "self"], {"copy": 0, "chat": 0})
        feedback = policy.take_feedback(["copy", "chat", "self"], [6, 6, 2], [0, 6, 1],
                                        num_tokens=17, started=0.0)
        assert feedback.accepted == {"copy": 6, "chat": 0, "self": 1}
        assert feedback.self_drafted == [("self", 1, 2)]  # the method hears of self-drafts
    copy, chat, fresh = policy.lookup_lengths(["copy", "chat", "new"], costs, 12)
    assert copy == 12 and chat == 0
    # A new request starts from the engine's lookup record (half of all
    # lookups accepted here), not from the self-draft's or a fixed prior.
    assert first[0] < fresh < copy
    assert policy.lookup_records.engine.accepted > 0
    # The engine's self-draft record is "self"'s alone (one accepted, one
    # rejection a round): the lookups stayed out.
    self_only = DraftPayoff()
    for _ in range(8):
        self_only.add_round(1, 1, ENGINE_PAYOFF_DECAY)
    assert policy.self_records.engine == self_only
    # Probe rounds are the lookup's own (F + a looked-up token: every 34th
    # round here, where a self-draft probe would come every 110th); lookup
    # records do not forget idle rounds (LOOKUP_PAYOFF_DECAY), so only probes
    # bring "chat" back.
    for rounds, length in ((0, 1), (34, 1), (35, 0), (110, 0), (235, 0)):
        policy.counters.rounds = rounds
        assert policy.lookup_lengths(["chat"], costs, 12) == [length], rounds
    assert set(policy.self_records.requests) == {"self"}  # lookups stay out of it
    assert policy.per_request_state() == {"self_records": 1, "lookup_records": 2,
                                          "looked_up": 2, "trials": 0}
    assert policy.lookup_lengths(["copy", "chat"], False, 12) == [12, 12]
    # A source that estimates each draft's chance itself (suffix trees) gets
    # the cap for every request, "chat" included: each draft is then cut by
    # its own estimate at the round's lookup costs.
    policy.counters.rounds = 35
    assert policy.lookup_lengths(["copy", "chat", "new"], costs, 12,
                                 source_sizes_drafts=True) == [12, 12, 12]
    # Lookup rounds timed with no fixed extra, as engines time them.
    timed = StepCosts(per_draft=0.8, round_overhead=0.3, per_verified=0.04,
                      lookup_overhead=0.0)
    sure, parting = [1.0, 1.0, 0.9, 0.5, 0.2, 0.1], [0.3, 0.1]
    # A 1-in-10 tail token is not worth its verification (0.04 plain steps).
    assert policy.source_draft_length("new", sure, 0, 1, timed, None) == 5
    assert policy.source_draft_length("new", parting, 0, 1, timed, None) == 2
    # At batch 8 every request waits through the drafts' verification: only
    # the likely head pays, and the unlikely draft not at all.
    assert policy.source_draft_length("new", sure, 0, 8, timed, None) == 3
    assert policy.source_draft_length("new", parting, 0, 8, timed, None) == 0
    assert policy.source_draft_length("new", parting, 0, 8, False, None) == 2
    # Alone in the batch, a request whose self-drafts are nearly always
    # accepted, at a cheap draft step, self-drafts rather than take a short
    # lookup (2 expected tokens where its self-draft promises more); a lookup
    # that beats its self-draft stands, and so does any lookup in a batch
    # (there a draft step is paid for every row) or where self-drafts are
    # closed (None).
    cheap = StepCosts(per_draft=0.2, round_overhead=0.05)
    for _ in range(20):
        policy.self_records.add_request_round("sure", 4, 4, policy.counters.rounds)
    assert policy.source_draft_length("sure", [1.0, 0.2], 0, 1, timed, cheap) == 0
    assert policy.source_draft_length("sure", [1.0] * 12, 0, 1, timed, cheap) == 12
    assert policy.source_draft_length("sure", [1.0, 0.2], 0, 8, timed, cheap) == 1
    assert policy.source_draft_length("sure", [1.0, 0.2], 0, 1, timed, None) == 2
    # A request whose self-drafts part from the target at once takes the lookup.
    for _ in range(20):
        policy.self_records.add_request_round("unsure", 0, 4, policy.counters.rounds)
    assert policy.source_draft_length("unsure", [1.0, 0.2], 0, 1, timed, cheap) == 2
    # Untimed lookups fall back to a draft token's cost: they stay short.
    assert StepCosts(per_draft=0.8).for_lookup() == StepCosts(0.8, 0.0, 0.8)


def test_lookups_are_held_to_what_their_match_length_accepts():
    """A suffix tree's estimate reads alike after a one-token match and a
    long one; the engine's record per match length holds each draft to what
    drafts found by matches that long accepted: after one-token matches' drafts
    were rejected, such a draft no longer pays (alone in the batch its
    request self-drafts), while drafts of long matches, accepted whole, keep
    their length. Matches longer than the longest record share it, and a
    draft whose source gives no match length (0) is not held."""
    from vllm_selfspec.policy.payoff import StepCosts

    policy = round_policy()
    timed = StepCosts(per_draft=0.8, round_overhead=0.3, per_verified=0.04,
                      lookup_overhead=0.0)
    cheap = StepCosts(per_draft=0.2, round_overhead=0.05)
    for _ in range(20):
        policy.self_records.add_request_round("r", 3, 4, policy.counters.rounds)
    tree = [0.5] * 6
    # Before any feedback both lengths start from the prior: the draft pays.
    assert policy.source_draft_length("r", tree, 1, 8, timed, None) > 0
    for _ in range(10):
        policy.note_lookups(["short", "long", "ngram"], {"short": 1, "long": 40, "ngram": 0})
        policy.take_feedback(["short", "long", "ngram"], [6, 6, 6], [6, 0, 6],
                             num_tokens=21, started=0.0)
    assert policy.match_records.acceptance(1) < 0.2
    assert policy.match_records.acceptance(40) > 0.9
    assert set(policy.match_records.records) == {1, 12}  # 40 shares the longest record
    assert policy.source_draft_length("r", tree, 1, 8, timed, None) == 0
    assert policy.source_draft_length("r", tree, 1, 1, timed, cheap) == 0
    # Where self-drafts are closed (None), one token of it still beats plain.
    assert policy.source_draft_length("r", tree, 1, 1, timed, None) == 1
    assert policy.source_draft_length("r", tree, 30, 1, timed, cheap) == 6
    assert policy.source_draft_length("r", tree, 0, 8, timed, None) == 6
    assert policy.timings()["lookup_acceptance_by_match_length"][1] < 0.2


def test_a_long_matchs_draft_is_valued_at_what_long_matches_accept():
    """After a long match a suffix tree's first estimate still reads about a
    half (the phrase seen once before and once now), where the target
    follows nearly always: valued at the tree's level such a draft lost to a
    self-draft accepting 0.9 alone in the batch; held to its match length's
    record it wins, and where the tree's continuations branch (its estimate
    falling along the path) the draft is cut there."""
    from vllm_selfspec.policy.payoff import StepCosts, best_speed, estimated_draft

    policy = round_policy()
    lookup_costs = StepCosts(per_draft=0.6, round_overhead=0.2, per_verified=0.11,
                             lookup_overhead=0.08)
    self_costs = StepCosts(per_draft=0.15, round_overhead=0.05)
    for _ in range(30):
        policy.self_records.add_request_round("r", 9, 10, policy.counters.rounds)
    for _ in range(30):
        policy.note_lookups(["long", "short"], {"long": 20, "short": 1})
        policy.take_feedback(["long", "short"], [6, 6], [0, 6], num_tokens=14, started=0.0)
    unique_path = [0.5] * 6
    level_valued = [min(p, policy.match_records.acceptance(20) ** i)
                    for i, p in enumerate(unique_path, start=1)]
    assert estimated_draft(level_valued, lookup_costs.for_lookup(1), 0.05)[1] < best_speed(
        policy.self_records.acceptances(["r"], policy.counters.rounds)[0], self_costs, 4)
    assert policy.source_draft_length("r", unique_path, 20, 1, lookup_costs, self_costs) == 6
    assert policy.source_draft_length("r", unique_path, 1, 1, lookup_costs, self_costs) == 0
    branching = [0.5, 0.5, 0.5, 0.1, 0.1, 0.1]
    assert policy.source_draft_length("r", branching, 20, 1, lookup_costs, self_costs) == 3


def test_feedback_goes_to_the_record_of_the_drafts_verified():
    """vLLM keeps the drafts of a request its token budget leaves out of a
    step and verifies them in a later one: that feedback goes to the record
    of the drafts it had (its lookup), not to whatever the last round did."""
    policy = round_policy()
    policy.note_lookups(["copy", "chat"], {"copy": 0})  # copy looks up, chat self-drafts
    policy.note_lookups(["chat"], {})  # copy left out of this step
    feedback = policy.take_feedback(["copy", "chat"], [5, 2], [0, 1], num_tokens=9,
                                    started=0.0)
    assert set(policy.lookup_records.requests) == {"copy"}
    assert set(policy.self_records.requests) == {"chat"}
    assert policy.lookup_records.engine.accepted == 5
    assert policy.self_records.engine.accepted == 1
    assert feedback.accepted == {"copy": 5, "chat": 1}
    assert feedback.self_drafted == [("chat", 1, 2)]  # the method hears of chat's alone
    policy.note_lookups(["copy", "chat"], {})  # both self-draft now
    assert policy.looked_up == {}


def test_rounds_are_timed_as_what_they_ran():
    """A round whose drafts were all looked up times a lookup round, one that
    only self-drafted a drafted round, one that did both neither, one that
    verified nothing a plain step; a forward with prefill tokens, or another
    batch, times nothing."""
    policy = round_policy()
    batch = ["a", "b"]
    cases = [  # previous round: steps, looked up; verified now, tokens now
        (0, True, [3, 2], 7), (2, False, [2, 2], 6), (2, True, [2, 3], 7),
        (0, False, None, 2), (0, True, [3, 2], 9), (2, False, [2, 2], 6)]
    for steps, looked_up, verified, num_tokens in cases:
        policy.end_round(batch, steps, 0.0, 0.001, looked_up)
        policy.start_round(batch, set(batch), verified, num_tokens, 0.01)
    policy.end_round(["a"], 0, 0.0, 0.001)
    policy.start_round(batch, set(batch), None, 2, 0.01)  # another batch
    samples = policy.clock.samples()
    assert samples["looked_up"] == {2: [(5, 0.01)]}
    assert samples["drafted"] == {2: [(2, 0.01), (2, 0.01)]}
    assert [round(seconds, 6) for _, seconds in samples["plain"][2]] == [0.009]


def test_the_goodput_gate_scores_drafting_against_several_plain_rounds():
    """One slow plain round (a new shape's first run, a pause of the machine)
    must not score a bucket's drafting many times faster than plain: the gate
    scores only against a median of PLAIN_ROUNDS_FIRST plain rounds or more."""
    from vllm_selfspec.policy.payoff import batch_bucket
    from vllm_selfspec.policy.rounds import PLAIN_ROUNDS_FIRST

    policy = round_policy()
    batch = ["a", "b", "c"]

    def plain_round(seconds: float) -> None:
        policy.end_round(batch, 0, 0.0, 0.0)
        policy.start_round(batch, set(batch), None, 3, seconds)

    def drafted_round() -> None:  # 2 steps, 1 accepted each, in a plain round's time
        policy.end_round(batch, 2, 0.0, 0.01)
        policy.start_round(batch, set(batch), [2, 2, 2], 9, 0.1)
        policy.take_feedback(batch, [2, 2, 2], [1, 1, 1], 9, 0.1)

    plain_round(1.0)  # ten times a plain round
    drafted_round()
    assert policy.gate.ratios() == {}, "scored against one plain round"
    for _ in range(PLAIN_ROUNDS_FIRST):
        plain_round(0.1)
    drafted_round()
    assert policy.gate.ratios() == {batch_bucket(3): pytest.approx(2.0)}


def test_lookup_costs_come_from_the_engines_own_lookup_rounds():
    """Lookup rounds timed as 1 + F_l + n v plain steps replace the
    profiling-mode share of a looked-up token (forward time, and noise where
    one more verified token costs little) with the engine's v and F_l; one
    lookup length alone, or a line that is not a cost, leaves the costs as
    they were."""
    from vllm_selfspec.policy.payoff import RoundClock, StepCosts

    plain_s, lookup_overhead, per_verified = 0.02, 0.08, 0.03
    prior = StepCosts(per_draft=0.6, round_overhead=0.2, per_verified=0.0)
    clock = RoundClock()
    for i in range(6):
        clock.record_plain(1, plain_s, round_index=i)
        for drafts in (2, 7, 12):
            clock.record_looked_up(1, drafts,
                                   plain_s * (1 + lookup_overhead + drafts * per_verified))
    costs = clock.costs(prior)[1]
    assert (costs.per_draft, costs.round_overhead) == (0.6, 0.2)  # self-draft costs kept
    assert abs(costs.per_verified - per_verified) < 1e-6
    lookup = costs.for_lookup()
    assert abs(lookup.round_overhead - lookup_overhead) < 1e-6
    assert lookup.per_draft == lookup.per_verified == costs.per_verified
    one_length = RoundClock()
    falling = RoundClock()
    for i in range(6):
        one_length.record_plain(1, plain_s, round_index=i)
        one_length.record_looked_up(1, 4, plain_s * 1.3)
        falling.record_plain(1, plain_s, round_index=i)
        falling.record_looked_up(1, 2 + i, plain_s * (1.5 - 0.05 * i))
    assert one_length.costs(prior) == {1: prior}
    assert falling.costs(prior) == {1: prior}
    # Short lookups as cheap as a plain round (the free line's intercept is
    # negative, as in every engine measured): no fixed extra, and the slope of
    # the line through the origin, sum(x y) / sum(x x) over the lengths.
    free_short = RoundClock()
    for i in range(6):
        free_short.record_plain(1, plain_s, round_index=i)
        for drafts in (2, 7, 12):
            free_short.record_looked_up(1, drafts, plain_s * (1 + 0.065 * drafts - 0.08))
    free_costs = free_short.costs(prior)[1]
    assert free_costs.lookup_overhead == 0.0
    assert abs(free_costs.per_verified - (0.065 - 0.08 * 21 / 197)) < 1e-6
    assert prior.for_lookup() == StepCosts(0.0, 0.2, 0.0)
    # At batch 4 every request waits through one request's lookup.
    assert lookup.per_draft * 4 == costs.for_lookup(4).per_draft


def test_dear_probes_are_spread_out():
    """A probe that finds nothing costs F + w plain steps: at most a share of
    decoding goes to them, and never more often than probe_every."""
    from vllm_selfspec.policy.payoff import StepCosts, probe_interval

    assert probe_interval(StepCosts(per_draft=0.1), 16, 0.02) == 16
    assert probe_interval(StepCosts(per_draft=0.84, round_overhead=0.87), 16, 0.02) == 86
    assert probe_interval(StepCosts(per_draft=0.64, round_overhead=2.65), 16, 0.02) == 165


def test_batch_drafts_only_when_the_drafting_rows_pay_for_the_whole_batch():
    """A draft step runs every row: at batch 1 the batch's steps are the
    request's own budget; at batch 4 one eager request cannot pay for a step
    the other three wait through, four together can."""
    from vllm_selfspec.policy.payoff import StepCosts, batch_steps, best_budget

    costs = StepCosts(per_draft=0.3, round_overhead=0.1)
    for acceptance in (0.3, 0.7, 0.95):
        own = best_budget(acceptance, costs, 8, 0.05)
        assert batch_steps([acceptance], [own], costs, 1, 0.05) == own
    assert best_budget(0.95, costs, 8, 0.05) > 0
    assert batch_steps([0.95, 0.0, 0.0, 0.0], [8, 0, 0, 0], costs, 4, 0.05) == 0
    assert batch_steps([0.95] * 4, [8] * 4, costs, 4, 0.05) > 0
    assert batch_steps([], [], costs, 4, 0.05) == 0


def test_round_clock_fits_fixed_and_per_draft_costs_from_steady_rounds():
    """Rounds timed as 1 + F + k w plain steps give back F and w; one draft
    count alone leaves F to the rest after the prior's w; the nearest batch
    size's costs serve a batch size never timed in its bucket only; windows
    stay bounded."""
    from vllm_selfspec.policy.payoff import RoundClock, StepCosts, costs_for

    plain_s, overhead, per_draft = 0.02, 0.3, 0.25
    prior = StepCosts(per_draft=0.5)
    clock = RoundClock(window=16)
    assert clock.costs(prior) == {} and clock.plain_seconds(1) is None
    for i in range(40):
        clock.record_plain(1, plain_s * (1 + 0.01 * (i % 3)), round_index=i)
        for steps in (1, 4, 4):
            clock.record_drafted(1, steps, plain_s * (1 + overhead + steps * per_draft))
    assert len(clock.plain[1]) == 16 and len(clock.drafted[1]) == 16
    assert clock.newest_plain_round == 39
    costs = clock.costs(prior)[1]
    assert abs(costs.per_draft - per_draft) < 0.02
    assert abs(costs.round_overhead - overhead) < 0.05
    # The nearest batch size timed serves within its bucket (1, 2, 3-4, 5-8):
    # batch 1's costs never decide at batch 4 (a batch-4 round drafts nothing
    # until a plain step there is timed).
    clock.record_plain(5, plain_s * 1.2, round_index=40)
    assert costs_for(clock.costs(prior), 1) == costs
    assert costs_for(clock.costs(prior), 4) is None and costs_for(clock.costs(prior), 9) is None
    assert costs_for(clock.costs(prior), 8) == clock.costs(prior)[5] != costs

    single = RoundClock()
    for i in range(5):
        single.record_plain(2, plain_s, round_index=i)
        single.record_drafted(2, 4, plain_s * (1 + overhead + 4 * per_draft))
    costs = single.costs(prior)[2]
    assert abs(costs.per_draft - 1.3 / 4) < 1e-9 and costs.round_overhead == 0.0  # prior's w too dear
    cheap_prior = StepCosts(per_draft=0.2)
    costs = single.costs(cheap_prior)[2]
    assert costs.per_draft == 0.2 and abs(costs.round_overhead - 0.5) < 1e-9
    convex = RoundClock()  # F too small to time: the fit keeps F >= 0 and refits w
    for i in range(5):
        convex.record_plain(1, plain_s, round_index=i)
        for steps in (1, 3):
            convex.record_drafted(1, steps, plain_s * (1 + 0.6 * steps - 0.2))
    costs = convex.costs(prior)[1]
    assert costs.round_overhead == 0.0
    assert abs(costs.per_draft - (0.6 - 0.2 * 4 / 10)) < 1e-6
    # Rounds whose cost varies (an early exit's depth) cost their mean, not
    # their median; a pause of the machine (the slowest tenth) does not count.
    spread = RoundClock()
    for i in range(19):
        spread.record_plain(1, plain_s, round_index=i)
        for steps in (1, 2):
            extra = 0.4 * steps if i < 14 else 0.4 * steps + 0.7 if i < 18 else 30.0
            spread.record_drafted(1, steps, plain_s * (1 + extra))
    costs = spread.costs(prior)[1]
    assert abs(costs.per_draft - 0.4) < 1e-6
    assert abs(costs.round_overhead - 0.7 * 4 / 18) < 1e-6  # the median's would be 0
    few = RoundClock()
    few.record_plain(1, plain_s, round_index=0)
    few.record_drafted(1, 4, plain_s * 3)
    assert few.costs(prior) == {1: prior}  # too few drafted rounds: the prior

    # A plain step timed again after a long run of drafting replaces the old
    # ones (contexts grew), and only recent plain rounds count as fresh.
    aged = RoundClock(horizon=100)
    for i in range(3):
        aged.record_plain(1, plain_s, round_index=i)
    assert aged.fresh_plain_rounds(50) == 3 and aged.fresh_plain_rounds(200) == 0
    aged.record_plain(1, 2 * plain_s, round_index=300)
    assert aged.plain_seconds(1) == 2 * plain_s and aged.fresh_plain_rounds(300) == 1


def test_a_repeated_decline_is_what_deciding_would_say():
    """Rounds that repeat the last decline without deciding again
    (`repeat_decline`, the cheap path) decline exactly where the full decision
    declines, also across a change of batch: probes and cost updates still
    come when they are due."""
    import time

    from vllm_selfspec.policy.payoff import StepCosts

    shared = []  # the rounds that shared costs from rank 0

    def rounds(repeat: bool) -> tuple[list[bool], int, int]:
        """Each round's decline, after a forward that verified nothing, as
        `SelfSpecProposer.decline_early` runs it without lookups: the repeat
        first (with `repeat`), else start, decide and end the round."""
        shared.clear()
        policy = round_policy(probe_every=8,
                              share=lambda make: shared.append(make()) or shared[-1])
        # Timed at start-up: stand-in costs at which drafting does not pay, so
        # only probes draft.
        policy.forward_times = SimpleNamespace(
            prior_at=lambda batch_size, max_drafts: StepCosts(per_draft=0.2, round_overhead=0.5))
        req_ids, held = ["a"], {"a": None}
        declined, repeated = [], 0
        for index in range(400):
            if index == 200:  # a second request joins
                req_ids, held = ["a", "b"], {"a": None, "b": None}
            if repeat and policy.repeat_decline(req_ids, held, len(req_ids)):
                repeated += 1
                declined.append(True)
                continue
            started = time.perf_counter()
            policy.start_round(list(req_ids), held, None, len(req_ids), started)
            decision = policy.decide(list(req_ids), 4, [True] * len(req_ids))
            declined.append(decision is None)
            if decision is None:
                policy.end_round(list(req_ids), 0, started, time.perf_counter())
            else:  # a probe: `propose` drafts, nothing verified after
                now = time.perf_counter()
                policy.end_round(list(req_ids), 1, now, now)
        return declined, repeated, len(shared)

    deciding, _, deciding_shared = rounds(repeat=False)
    repeating, repeated, repeating_shared = rounds(repeat=True)
    assert repeated > 300
    assert repeating == deciding and repeating_shared == deciding_shared > 20
    assert 2 <= deciding.count(False) <= 10  # the first timing rounds decline too


def test_a_step_vllm_skipped_the_drafter_in_ends_a_run_of_repeated_declines():
    """After a quiet decline, a step whose drafter vLLM skipped (a request at
    max_model_len) leaves no previous round: the next round decides again
    (it raised AttributeError on the missing round before)."""
    import time

    from vllm_selfspec.policy.payoff import StepCosts

    policy = round_policy(probe_every=8)
    policy.forward_times = SimpleNamespace(
        prior_at=lambda batch_size, max_drafts: StepCosts(per_draft=0.2, round_overhead=0.5))
    req_ids, held = ["a"], {"a": None}
    for _ in range(80):  # until a decline is quiet (repeatable without deciding)
        if policy.repeat_decline(req_ids, held, 1):
            break
        started = time.perf_counter()
        policy.start_round(list(req_ids), held, None, 1, started)
        if policy.decide(list(req_ids), 4, [True]) is None:
            policy.end_round(list(req_ids), 0, started, time.perf_counter())
    else:
        raise AssertionError("no decline was repeated in 80 rounds")
    policy.skip_round(req_ids)
    assert policy.repeat_decline(req_ids, held, 1) is False


def test_a_compute_bound_batch_drafts_nothing_and_a_light_one_drafts():
    """The stand-in costs follow the load: from recorded start-up times, a
    request that accepts 75 % of its self-drafts (the int8 full-depth draft's
    figure on this model) drafts alone, while a batch of 16 such requests
    (compute-bound: every verified token adds its share of the forward)
    drafts no step; batch 1's costs never stand in at 16."""
    from vllm_selfspec.policy.payoff import ForwardTimes, batch_steps, best_budget
    from vllm_selfspec.policy.rounds import MIN_GAIN

    times = ForwardTimes(**RECORDED_FORWARD_TIMES)
    light, loaded = times.prior_at(1, 12), times.prior_at(16, 12)
    assert loaded.per_draft > 2 * light.per_draft
    budget = best_budget(0.75, light, 12, MIN_GAIN)
    assert budget >= 2 and batch_steps([0.75], [budget], light, 1, MIN_GAIN) == budget
    assert best_budget(0.75, loaded, 12, MIN_GAIN) == 0
    assert batch_steps([0.75] * 16, [12] * 16, loaded, 16, MIN_GAIN) == 0
    # Only requests that nearly always accept still pay for a step at 16.
    assert batch_steps([0.95] * 16, [12] * 16, loaded, 16, MIN_GAIN) > 0
    # A lookup pays per verified token, which every request of the batch
    # waits through (for_lookup): long at batch 1, short at 16.
    assert best_budget(0.7, light.for_lookup(1), 12, MIN_GAIN) >= 6
    assert best_budget(0.7, loaded.for_lookup(16), 12, MIN_GAIN) <= 2


def test_drafting_rounds_measured_slower_than_plain_close_their_batch_size():
    """The goodput gate, on rounds recorded by a loaded engine (SmolLM2, int8
    draft with lookups, 16 requests at temperature 0.8, float32 on AVX2): there
    14 of 16 requests self-drafted one token and accepted 90 % of them, which
    the cost model scored as paying, yet each such round took 0.40-0.58 s where
    a plain round took 0.205 s. The gate closes that batch size (a try every
    so many rounds, costing at most 1 % of decoding), leaves batch 1, where
    drafting doubled the tokens per second, open, and reopens batch 16 once
    its tries pay."""
    from vllm_selfspec.policy.payoff import GoodputGate, batch_bucket, reopen_interval

    gate = GoodputGate()
    loaded = [(29, 0.487), (28, 0.511), (29, 0.568), (28, 0.453), (29, 0.540)]
    alone = [(4, 0.241), (3, 0.199), (5, 0.295), (2, 0.161)]
    for (tokens, seconds), (alone_tokens, alone_seconds) in zip(loaded[:3], alone[:3]):
        gate.record(16, tokens, seconds, plain_seconds=0.205)
        gate.record(1, alone_tokens, alone_seconds, plain_seconds=0.105)
    assert gate.closed() == {}, "three rounds are too few to close a bucket"
    for tokens, seconds in loaded[3:]:
        gate.record(16, tokens, seconds, plain_seconds=0.205)
    gate.record(1, *alone[3], plain_seconds=0.105)
    ratios = gate.ratios()
    assert ratios[batch_bucket(1)] > 1.5
    assert ratios[batch_bucket(16)] == pytest.approx(0.72, abs=0.03)
    assert set(gate.closed()) == {batch_bucket(16)}
    assert batch_bucket(12) == batch_bucket(16) != batch_bucket(8)
    ratio = gate.closed()[batch_bucket(16)]
    interval = reopen_interval(ratio, 16, 0.01)
    assert (1 / ratio - 1) / interval <= 0.01 and interval <= 64
    assert reopen_interval(0.99, 16, 0.01) == 16
    # The texts turn predictable: tries that verify 16 accepted drafts cost
    # little more than a plain round; a few of them reopen the bucket.
    for _ in range(4):
        gate.record(16, 32, 0.26, plain_seconds=0.205)
    assert gate.closed() == {}
    # A bucket whose drafting rounds only level plain's closes too (the 5 %
    # margin budgets ask for), so it does not flip open and closed.
    level = GoodputGate()
    for _ in range(4):
        level.record(8, 9, 0.215, plain_seconds=0.2)
    assert set(level.closed()) == {batch_bucket(8)}


def test_one_pause_of_the_machine_among_the_first_rounds_does_not_stop_drafting():
    """Rounds an engine timed (SmolLM2, float32, int8 full-depth draft, batch 1):
    plain rounds of 0.039 s, then three one-draft rounds, the third
    paused (0.263 s). Taken whole, that pause made a round's fixed cost 1.8
    plain steps, every later round declined, and no round was timed again to
    correct it. Without the slowest of three the costs are the other two
    rounds', at which a 95 %-accepted request drafts; the goodput gate leaves
    the bucket open over the same rounds, and still closes it if most
    rounds are slow."""
    from vllm_selfspec.policy.payoff import (
        GoodputGate,
        RoundClock,
        StepCosts,
        best_budget,
        without_pauses,
    )

    plain_s = 0.039
    clock = RoundClock()
    for i in range(8):
        clock.record_plain(1, plain_s, round_index=i)
    drafted = [0.069, 0.076, 0.263]
    for seconds in drafted:
        clock.record_drafted(1, 1, seconds, round_index=8)
    costs = clock.costs(StepCosts(per_draft=0.59))[1]
    extra = ((0.069 + 0.076) / 2) / plain_s - 1.0
    assert costs.per_draft + costs.round_overhead == pytest.approx(extra)
    assert best_budget(0.95, costs, 8, 0.05) > 0
    assert without_pauses([3.0, 1.0]) == [1.0, 3.0], "two rounds are too few to drop one"

    gate = GoodputGate()
    for seconds in [*drafted, 0.070]:
        gate.record(1, 2, seconds, plain_seconds=plain_s)
    assert gate.closed() == {}
    for seconds in (0.09, 0.10):
        gate.record(1, 2, seconds, plain_seconds=plain_s)
    assert set(gate.closed()) == {0}


def test_forward_times_read_between_and_beyond_the_grid():
    from vllm_selfspec.policy.payoff import ForwardTimes, timing_grid

    assert timing_grid(208) == (1, 4, 16, 64, 208) and timing_grid(1) == (1,)
    times = ForwardTimes(**RECORDED_FORWARD_TIMES)
    # Non-decreasing (batch 1's noisy 118 ms holds up to 4 tokens), linear between
    # points, extended along the last segment; floats, so RPCs can carry them.
    assert times.target(2) == pytest.approx(0.1179)
    assert times.target(40) == pytest.approx((0.1581 + 0.3354) / 2)
    assert times.target(352) == pytest.approx(0.9510 + (0.9510 - 0.3354))
    assert type(times.draft(32)) is float and times.draft(32) > times.draft(16)


def test_drafting_resumes_after_a_slow_spell_of_the_machine():
    """Drafted rounds timed while the machine ran slow make drafting look dear
    and stop it; they age as plain rounds do, so once the engine has timed
    plain rounds for `horizon` rounds after the machine recovered, the costs
    are the stand-in's again and the request drafts (within 512 + 16 rounds:
    plain rounds are re-timed at least that often, and costs shared every 16)."""
    from vllm_selfspec.policy.payoff import RoundClock, StepCosts, best_budget

    prior = StepCosts(per_draft=0.3, round_overhead=0.1)
    clock = RoundClock()
    plain_s = 0.02
    for index in range(5):
        clock.record_plain(1, plain_s, index)
    for index in range(5, 20):  # a slow spell: every drafted round 3 plain steps dearer
        clock.record_drafted(1, 1 + index % 3, plain_s * (4 + 0.3 * (1 + index % 3)), index)
    slow = clock.costs(prior)[1]
    assert best_budget(0.8, slow, 8, 0.05) == 0
    for index in range(20, 20 + 512, 64):  # recovered: plain rounds re-timed
        clock.record_plain(1, plain_s, index)
        assert clock.costs(prior)[1] == slow  # still within the horizon
    clock.record_plain(1, plain_s, 20 + 512)
    assert clock.costs(prior)[1] == prior and best_budget(0.8, prior, 8, 0.05) > 0


@pytest.mark.parametrize("lookups_pay", [True, False])
def test_lookups_and_self_drafts_are_gated_apart(lookups_pay):
    """Rounds that only looked up are scored apart from rounds that
    self-drafted: at a batch size where self-drafting rounds lose to plain
    (4 requests, 2 self-drafts each, 1 accepted, in three plain rounds'
    time), lookups that pay (3 accepted each in little more than a plain
    round's time) still draft, and where the lookups lose and the self-drafts
    pay, the self-drafts still draft. Off the closed bucket's tries, the closed
    kind's costs are None and the other's are the engine's."""
    from vllm_selfspec.policy.payoff import ForwardTimes, batch_bucket, reopen_interval
    from vllm_selfspec.policy.rounds import PROBE_SHARE

    policy = round_policy()
    policy.forward_times = ForwardTimes(**RECORDED_FORWARD_TIMES)
    batch, clock = ["a", "b", "c", "d"], [0.0]

    def run(steps: int, looked_up: bool, verified: int, accepted: int, seconds: float) -> None:
        now = clock[0]
        policy.end_round(batch, steps, now, now + 0.001, looked_up)
        drafts = [verified] * len(batch) if verified else None
        policy.start_round(batch, set(batch), drafts, len(batch) * (1 + verified),
                           now + seconds)
        policy.take_feedback(batch, drafts, None if drafts is None
                             else [verified - accepted] * len(batch),
                             len(batch) * (1 + verified), now + seconds)
        clock[0] = now + seconds

    for _ in range(4):
        run(0, False, 0, 0, 0.1)  # plain rounds
    winner, loser = ((True, 3, 3, 0.12), (False, 2, 1, 0.3)) if lookups_pay else (
        (False, 2, 2, 0.12), (True, 3, 0, 0.3))
    for _ in range(6):
        for looked_up, verified, accepted, seconds in (winner, loser):
            run(0 if looked_up else verified, looked_up, verified, accepted, seconds)
    losing_gate, winning_gate = ((policy.gate, policy.lookup_gate) if lookups_pay
                                 else (policy.lookup_gate, policy.gate))
    bucket = batch_bucket(len(batch))
    assert set(losing_gate.closed()) == {bucket} and winning_gate.closed() == {}
    for _ in range(64):  # to a round that shares the gates and is not a try of the closed bucket
        policy.start_round(batch, set(batch), None, len(batch), clock[0])
        policy.timed_costs(len(batch))
        interval = reopen_interval(losing_gate.closed()[bucket], 16, PROBE_SHARE)
        if policy.counters.rounds % interval and policy.shared_costs:
            break
    else:
        pytest.fail("no round shared the gates' closed buckets")
    closed = policy.shared_closed if lookups_pay else policy.shared_lookup_closed
    assert set(closed) == {bucket}
    assert policy.goodput()["lookups" if lookups_pay else "self_drafts"]["closed"] == {}
    self_costs, lookup_costs = policy.timed_costs(len(batch)), policy.lookup_costs(len(batch))
    assert (self_costs is None) == lookups_pay and (lookup_costs is None) != lookups_pay
    rounds = policy.counters.rounds
    assert policy.closed(len(batch), rounds, lookups=not lookups_pay)
    assert not policy.closed(len(batch), rounds, lookups=lookups_pay)


def test_pinned_costs_stand_in_for_the_timings_and_the_gates():
    """Costs pinned from outside (the tests' engines decide alike on any
    CPU) are every round's, self-drafts' and lookups', with no plain round
    timed and at a batch size the goodput gates closed; unpinned, the engine's
    timings and gates decide again."""
    from vllm_selfspec.policy.payoff import ForwardTimes, StepCosts, batch_bucket

    policy = round_policy()  # fails if it asks for timings
    pinned = StepCosts(per_draft=0.2, round_overhead=0.1, per_verified=0.02)
    policy.shared_closed = {batch_bucket(1): 0.5}
    policy.shared_lookup_closed = {batch_bucket(1): 0.5}
    policy.pin_costs(pinned)
    for _ in range(20):  # tries of the closed buckets aside, every round
        policy.start_round(["a"], {"a"}, None, 1, 0.0)
        assert policy.timed_costs(1) is pinned and policy.lookup_costs(1) is pinned
        assert not policy.next_round_closed(1) and not policy.next_round_closed(1, lookups=True)
    decision = policy.decide(["a"], 4, [True])
    assert decision is not None and decision.steps > 0
    policy.pin_costs(None)
    rounds = policy.round_index
    # Unpinned, the closed bucket's rounds are closed again but for its tries.
    assert sum(policy.closed(1, r) for r in range(rounds, rounds + 8)) >= 7
    policy.forward_times = ForwardTimes(**RECORDED_FORWARD_TIMES)
    policy.start_round(["a"], {"a"}, None, 1, 0.0)
    # Unpinned and with no costs shared yet, the round drafts nothing: it times
    # a plain step.
    assert policy.timed_costs(1) is None


def test_a_try_of_a_bucket_closed_to_lookups_is_decided_not_repeated():
    """Where self-drafts decline by their budgets (so rounds repeat the last
    decline without deciding, `repeat_decline`) and lookup rounds were
    measured at half a plain round's speed (the bucket closed to lookups),
    each of the bucket's tries still decides, so lookups may draft in it:
    a try must not fall inside a run of repeated declines."""
    import time

    from vllm_selfspec.policy.payoff import StepCosts

    policy = round_policy(probe_every=8)
    policy.forward_times = SimpleNamespace(
        prior_at=lambda batch_size, max_drafts: StepCosts(per_draft=0.2, round_overhead=0.5))
    for _ in range(4):
        policy.lookup_gate.record(1, 1, 0.2, plain_seconds=0.1)
    req_ids, held = ["a"], {"a": None}
    tries, repeated = 0, 0
    for _ in range(400):
        is_try = (bool(policy.goodput()["lookups"]["closed"])
                  and not policy.next_round_closed(1, lookups=True))
        if policy.repeat_decline(req_ids, held, 1):
            assert not is_try, policy.round_index
            repeated += 1
            continue
        tries += is_try
        started = time.perf_counter()
        policy.start_round(req_ids, held, None, 1, started)
        decision = policy.decide(req_ids, 4, [True])
        now = time.perf_counter()
        policy.end_round(req_ids, 0 if decision is None else 1, started if decision is None
                         else now, now)
    assert repeated > 250 and tries >= 3, (repeated, tries)
