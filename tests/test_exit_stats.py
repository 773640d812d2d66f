"""Drafts' stopping and exit arithmetic against values computed by hand: Draft
& Verify's adaptive confidence threshold, DEL's statistics from the paper's
formulas, and the gate that keeps AdaDecode's heads only where they beat the
full-depth draft they replace."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_selfspec.policy.confidence_stop import REFERENCE_RULE, ConfidenceStop, ThresholdRule
from vllm_selfspec.policy.exit_gate import BASE, ExitGate
from vllm_selfspec.policy.exit_stats import ExitStats, tokens_per_layer
from vllm_selfspec.policy.payoff import StepCosts

LAYERS = np.array([8, 15, 22])


def test_the_threshold_rises_while_acceptance_is_below_target_and_falls_above_it():
    stop = ConfidenceStop(REFERENCE_RULE)
    assert stop.gammas(["a", "b"]) == [0.6, 0.6]
    stop.observe("a", accepted=1, drafted=4)  # AR = 0.25 <= 0.9: gamma -> 0.9*0.6 + 0.1*0.61
    assert stop.requests["a"].acceptance == 0.25
    assert stop.gammas(["a"]) == [pytest.approx(0.601)]
    stop.observe("a", accepted=4, drafted=4)  # AR = 0.625, still below: up again
    assert stop.requests["a"].acceptance == 0.625
    assert stop.gammas(["a"]) == [pytest.approx(0.9 * 0.601 + 0.1 * 0.611)]
    for _ in range(3):
        stop.observe("b", accepted=4, drafted=4)  # AR = 1 > 0.9: down each round
    assert stop.gammas(["b"]) == [pytest.approx(0.597)]
    assert not stop.never_stops()


def test_a_fixed_threshold_stays_and_zero_never_stops():
    fixed = ConfidenceStop(ThresholdRule(threshold=0.3, adaptive_threshold=False))
    fixed.observe("a", accepted=0, drafted=4)
    assert fixed.gammas(["a"]) == [0.3] and not fixed.never_stops()
    assert ConfidenceStop(ThresholdRule(threshold=0.0, adaptive_threshold=False)).never_stops()


def test_options_changed_while_serving_apply_to_every_request():
    options = SimpleNamespace(**asdict(REFERENCE_RULE))  # draft_verify's, set by RPC
    stop = ConfidenceStop(options)
    stop.observe("a", accepted=0, drafted=4)
    assert stop.gammas(["a"]) == [pytest.approx(0.601)]
    options.adaptive_threshold, options.threshold = False, 0.3
    assert stop.gammas(["a", "new"]) == [0.3, 0.3]
    options.threshold = 0.0
    assert stop.never_stops()


def test_thresholds_are_held_for_live_requests_only():
    stop = ConfidenceStop(REFERENCE_RULE)
    for req_id in "abc":
        stop.observe(req_id, accepted=2, drafted=3)
    stop.forget({"b"})
    assert len(stop) == 1 and set(stop.requests) == {"b"}


def one_round(decay: float = 0.95) -> ExitStats:
    """5 valid positions; layers 8/15/22 match 2/3/4 of them."""
    stats = ExitStats(LAYERS, decay)
    stats.update(5, np.array([2.0, 3, 4]), np.array([1.8, 2.7, 3.6]),
                 np.array([0.9, 0.4, 0.1]))
    return stats


def test_acceptance_and_threshold_of_one_round():
    stats = one_round()
    assert stats.acceptance() == pytest.approx([0.4, 0.6, 0.8])
    # tau = (mean matched confidence + mean mismatched confidence) / 2
    # layer 8: (1.8/2 + 0.9/3)/2 = 0.6; 15: (0.9 + 0.4/2)/2 = 0.55; 22: (0.9 + 0.1)/2
    assert stats.thresholds() == pytest.approx([0.6, 0.55, 0.5])


def test_decayed_sums():
    stats = one_round(decay=0.5)
    stats.update(1, np.array([1.0, 0, 1]), np.array([0.5, 0, 0.9]), np.array([0, 0.2, 0]))
    # S(u) = 0.5*5 + 1 = 3.5; S(c) = [2, 1.5, 3]
    assert stats.acceptance() == pytest.approx([2 / 3.5, 1.5 / 3.5, 3 / 3.5])
    # layer 15: S(tcs) = 1.35, S(c) = 1.5; S(fcs) = 0.4, S(u-c) = 2.0
    assert stats.thresholds()[1] == pytest.approx((1.35 / 1.5 + 0.4 / 2.0) / 2)


def test_tokens_per_layer():
    tpl = tokens_per_layer(np.array([0.4, 0.6, 0.8]), LAYERS, 30, 3)
    assert tpl[:, 0] == pytest.approx([1 / 30] * 3)  # no drafts: one token, L layers
    assert tpl[0, 1] == pytest.approx(1.4 / 38)  # (1 + a) / (8 + 30)
    assert tpl[2, 2] == pytest.approx((1 + 0.8 + 0.64) / (2 * 22 + 30))
    assert tokens_per_layer(np.array([1.0]), np.array([10]), 30, 4)[0, 4] == (
        pytest.approx(5 / 70))  # alpha = 1: d + 1 tokens


def test_choice_maximises_tokens_per_layer():
    stats = one_round()
    # TPL(8, 1) = 1.4/38 = 0.0368 beats TPL(15, 1) = 0.0356, TPL(22, 1) = 0.0346
    # and every d = 0 (1/30): draft at layer 8, length set by tau (up to d_max).
    choice = stats.choose(30, 18)
    assert (choice.exit_layer, choice.max_drafts) == (8, 18)
    assert choice.threshold == pytest.approx(0.6)
    assert choice.acceptance == pytest.approx(0.4)


def test_fixed_exit_layer_and_length():
    stats = one_round()
    choice = stats.choose(30, 18, fixed_exit_layer=22)
    assert (choice.exit_layer, choice.max_drafts) == (22, 18)  # TPL(22, 1) > 1/30
    assert choice.threshold == pytest.approx(0.5)
    # d = 2: layer 8 1.56/46 = 0.0339 > layer 22 2.44/74 = 0.0330 > layer 15
    static = stats.choose(30, 18, fixed_length=2)
    assert (static.exit_layer, static.max_drafts, static.threshold) == (8, 2, 0.0)


def test_no_drafting_when_no_layer_pays():
    stats = ExitStats(LAYERS, 0.95)
    stats.update(4, np.zeros(3), np.zeros(3), np.array([2.0, 2, 2]))
    choice = stats.choose(30, 18)
    assert choice.max_drafts == 0
    assert choice.threshold == pytest.approx(0.25)  # (0 + 2/4) / 2


def test_full_agreement_drafts_the_longest():
    stats = ExitStats(np.array([30]), 0.95)
    stats.update(3, np.array([3.0]), np.array([2.7]), np.array([0.0]))
    choice = stats.choose(30, 18)
    assert (choice.max_drafts, choice.acceptance) == (18, 1.0)
    assert choice.threshold == pytest.approx(0.45)  # no mismatch seen: (0.9 + 0) / 2


def test_step_overhead_counts_a_forward_s_fixed_cost():
    """o layers per forward: TPL(l, d) = sum alpha^i / (d*(l+o) + L + o)."""
    tpl = tokens_per_layer(np.array([0.4, 0.8]), np.array([8, 22]), 30, 2, step_overhead=30)
    assert tpl[0, 0] == pytest.approx(1 / 60)
    assert tpl[0, 1] == pytest.approx(1.4 / (38 + 60))
    assert tpl[1, 2] == pytest.approx(2.44 / (2 * 52 + 60))


def test_step_overhead_moves_the_choice_deeper():
    """alpha = 0.5 / 0.6 / 0.9 at layers 8 / 15 / 22. Layers only (o = 0):
    TPL(8, 1) = 1.5/38 = 0.0395 beats TPL(22, 2) = 2.71/74 = 0.0366. With o = 10
    a shallow draft pays the fixed cost like a deep one: TPL(8, 1) = 1.5/58 =
    0.0259 < TPL(22, 1) = 1.9/72 = 0.0264, which also beats 1/40 (no draft)."""
    stats = ExitStats(LAYERS, 0.95)
    stats.update(10, np.array([5.0, 6, 9]), np.array([4.0, 5, 8]), np.array([2.0, 2, 0.5]))
    assert stats.choose(30, 18).exit_layer == 8
    tpl = tokens_per_layer(stats.acceptance(), LAYERS, 30, 3, step_overhead=10)
    assert tpl[0, 1] == pytest.approx(1.5 / 58)
    assert tpl[2, 1] == pytest.approx(1.9 / 72)
    choice = stats.choose(30, 18, step_overhead=10)
    assert (choice.exit_layer, choice.max_drafts) == (22, 18)
    assert stats.choose(30, 18, step_overhead=100).max_drafts == 0  # 1/130 > 1.9/252


def test_top1_is_the_argmax_and_its_softmax_probability():
    """DEL's shadow tokens and confidences come from `top1` over bf16 logits."""
    import torch

    from vllm_selfspec.draft.tokens import top1, top1_probability

    torch.manual_seed(0)
    logits = (torch.randn(5, 1000) * 4).to(torch.bfloat16)
    token_ids, probability = top1(logits)
    reference = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(token_ids, logits.float().argmax(dim=-1))
    assert torch.allclose(probability, reference.max(dim=-1).values, atol=1e-6)
    assert torch.allclose(probability, top1_probability(logits))
    assert probability.dtype == torch.float32


# AdaDecode's gate over the full-depth base (policy/exit_gate.py).
GATE_COSTS = StepCosts(per_draft=0.5, round_overhead=0.1, per_verified=0.1)


def gate_with(base: tuple[int, int], heads: list[tuple[int, int]],
              where_sure: list[tuple[int, int]] | None = None) -> ExitGate:
    """A gate over heads at 8, 15 and 22 of 30 layers whose base, heads and
    base where each head was sure were reached and accepted these many times
    (one draft per record), in rounds of 5 drafts; no probe or shadow round
    comes in these tests."""
    gate = ExitGate([8 / 30, 15 / 30, 22 / 30], decay=1.0, probe_every=10**6)
    shadowed = [(gate.shadowed(h), counts) for h, counts in enumerate(where_sure or [])]
    for source, (accepted, reached) in [(BASE, base), *enumerate(heads), *shadowed]:
        for index in range(reached):
            gate.record([source], 1 if index < accepted else 0)
    gate.drafted = 5.0 * gate.request_rounds
    return gate


def opened(gate: ExitGate, costs: StepCosts | None = GATE_COSTS, batch_size: int = 1):
    return gate.next_round(costs, batch_size, max_drafts=5).open


def test_the_gate_counts_drafts_up_to_the_first_rejection():
    gate = ExitGate([0.5], decay=1.0, min_reached=1)
    gate.record([0, BASE, BASE, 0], accepted=1)  # head accepted, base rejected, rest unseen
    assert gate.reached == [1.0, 0.0, 1.0] and gate.accepted == [1.0, 0.0, 0.0]
    gate.record([BASE, 0, gate.shadowed(0)], accepted=3)  # all accepted: all reached
    assert gate.acceptance(0) == 1.0 and gate.acceptance(BASE) == 0.5
    assert gate.acceptance(gate.shadowed(0)) == 1.0


def test_a_head_accepted_far_less_than_the_base_closes_and_a_head_as_good_stays_open():
    # Base 0.89: the shallow head at 0.62 loses (break-even about 0.77 at these
    # costs); the middle one at 0.89 saves half a draft step for nothing; the
    # deep one at 0.80 saves too little for what it loses.
    gate = gate_with((89, 100), [(62, 100), (89, 100), (80, 100)])
    assert opened(gate) == [False, True, False]


def test_a_head_is_weighed_against_the_base_on_the_tokens_it_is_sure_of():
    # The shallow head at 0.80 beats the base's 0.70 average, but where it is
    # sure the full-depth draft is accepted 0.95 of the time: it closes.
    head = [(80, 100), (0, 1), (0, 1)]
    assert opened(gate_with((70, 100), head))[0] is True
    assert opened(gate_with((70, 100), head, where_sure=[(95, 100)]))[0] is False


def test_unmeasured_heads_open_one_round_in_measure_every_and_the_gate_probes_and_shadows():
    no_base = gate_with((5, 5), [(0, 5), (0, 5), (0, 5)])  # under min_reached
    assert [opened(no_base) for _ in range(4)] == [[False] * 3] * 4  # the base drafts alone
    unmeasured = gate_with((90, 100), [(0, 5), (0, 5), (0, 5)])
    unmeasured.measure_every = 4
    assert [opened(unmeasured) for _ in range(4)] == [[False] * 3] * 3 + [[True] * 3]
    losing = gate_with((90, 100), [(10, 100)] * 3)
    assert opened(losing) == [False] * 3
    assert opened(losing, costs=None) == [True] * 3  # not cost-aware
    losing.probe_every = 4
    assert losing.rounds == 2
    rounds = [losing.next_round(GATE_COSTS, 1, 5) for _ in range(4)]  # rounds 3..6
    assert [r.open for r in rounds] == [[False] * 3, [True] * 3, [False] * 3, [False] * 3]
    assert [r.shadow for r in rounds] == [False, False, False, True]


def test_a_round_that_opens_heads_to_measure_them_is_a_trial():
    """Heads opened because they have no record, or by a probe, are a trial
    (their outcome is not what the method's steady drafts accept); a head
    open because it pays, heads closed, a shadow round and a gate that is not
    cost-aware are not."""
    no_base = gate_with((5, 5), [(0, 5)] * 3)
    assert not any(no_base.next_round(GATE_COSTS, 1, 5).trial for _ in range(8))
    one_unmeasured = gate_with((89, 100), [(62, 100), (89, 100), (0, 5)])
    one_unmeasured.measure_every = 4
    rounds = [one_unmeasured.next_round(GATE_COSTS, 1, 5) for _ in range(4)]
    assert [r.trial for r in rounds] == [False, False, False, True]
    assert [r.open for r in rounds] == [[False, True, False]] * 3 + [[False, True, True]]
    paying = gate_with((89, 100), [(62, 100), (89, 100), (80, 100)])
    assert not paying.next_round(GATE_COSTS, 1, 5).trial  # the middle head open: it pays
    assert not paying.next_round(None, 1, 5).trial
    paying.probe_every = 4
    rounds = [paying.next_round(GATE_COSTS, 1, 5) for _ in range(4)]  # rounds 3..6
    assert [r.trial for r in rounds] == [False, True, False, False]
    assert rounds[3].shadow


def test_the_rounds_length_is_the_mean_of_the_drafts_verified():
    gate = ExitGate([0.5], decay=1.0)
    assert gate.round_length(12) == 12  # before any round
    gate.record([BASE, BASE, BASE], accepted=3)
    gate.record([BASE], accepted=0)
    assert gate.round_length(12) == 2 and gate.round_length(1) == 1


def test_a_head_is_weighed_at_the_rounds_measured_length():
    """Base 0.93, a shallow head at 0.90: in rounds of 4 drafts its saved draft
    step pays for its acceptance (break-even 0.87); were rounds 12 long, the
    saving would be spread over 12 draft steps (break-even 0.94)."""
    gate = gate_with((93, 100), [(90, 100), (90, 100), (90, 100)])
    gate.drafted = 4.0 * gate.request_rounds
    assert gate.next_round(GATE_COSTS, 1, max_drafts=12).open[0] is True
    gate.drafted = 12.0 * gate.request_rounds
    assert gate.next_round(GATE_COSTS, 1, max_drafts=12).open[0] is False


def test_a_head_pays_where_the_draft_step_is_dear_and_only_at_batch_one():
    # The same head and base: at a cheap draft step the exit's saving cannot
    # make up for its acceptance, at a dear one it does by more than the
    # 5 % margin; at batch 2 a step
    # stops early only when both rows exit, so no saving is counted.
    gate = gate_with((90, 100), [(85, 100), (85, 100), (85, 100)])
    assert opened(gate, StepCosts(per_draft=0.1, round_overhead=0.1))[0] is False
    dear = StepCosts(per_draft=1.0, round_overhead=0.1)
    assert opened(gate, dear)[0] is True
    assert opened(gate, dear, batch_size=2)[0] is False
