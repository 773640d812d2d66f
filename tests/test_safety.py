"""Engine-free checks of what a client or an operator can send: SWIFT's task
keys and export paths, the benchmark RPCs' option changes, and the state a
method keeps per request."""

from __future__ import annotations

import pytest

from vllm_selfspec.diagnostics import set_option
from vllm_selfspec.policy.confidence_stop import REFERENCE_RULE, ConfidenceStop
from vllm_selfspec.policy.skip_search import CompileBudget, TaskSlots, task_name
from vllm_selfspec.proposers.adadecode import AdaDecodeProposer
from vllm_selfspec.proposers.draft_verify import DraftVerifyConfig, DraftVerifyProposer
from vllm_selfspec.proposers.swift import export_path


@pytest.mark.parametrize("key", ["code", "task_1", "A-b", "x" * 64])
def test_valid_task_names(key):
    assert task_name(key) == key


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/b", "..", "", "x" * 65,
                                 "a b", "ü", 7, None, ["code"]])
def test_invalid_task_names(key):
    assert task_name(key) is None


def test_export_stays_inside_export_dir(tmp_path):
    assert export_path(str(tmp_path), "code") == (tmp_path / "code.json").resolve()
    for task in ("../escaped", "/tmp/escaped", "a/../../b"):
        with pytest.raises(ValueError, match="not a valid task name"):
            export_path(str(tmp_path), task)


def test_idle_tasks_expire_least_recently_used_first():
    """max_tasks 3 ("default" + 2): a third key takes the slot of the least
    recently used task that has no request in the batch; while both held
    tasks are in the batch, a new key joins "default". Searches held never
    pass the capacity, however many keys arrive."""
    made = []
    slots = TaskSlots(3, lambda: made.append(1) or len(made))
    assert slots.assign(["a", None]) == ["a", "default"]
    assert slots.assign(["b"]) == ["b"]
    assert slots.assign(["a"]) == ["a"]  # "b" is now the least recently used
    assert slots.assign(["c", "a"]) == ["c", "a"]  # "b" expires, "a" stays
    assert list(slots.searches) == ["default", "c", "a"] and slots.expired == 1
    assert slots.assign(["c", "a", "d"]) == ["c", "a", "default"]  # nothing idle
    assert slots.refused == {"over_max_tasks": 1}
    assert slots.assign(["../x", 7]) == ["default", "default"]
    assert slots.refused == {"over_max_tasks": 1, "invalid": 2}
    for index in range(100):
        slots.assign([f"key-{index}"])
        assert len(slots.searches) <= 3 and "default" in slots.searches
    assert slots.assign(["c"]) == ["c"]  # an expired task comes back with a new search
    assert slots.searches["c"] == len(made)


def test_learned_sets_compile_within_a_share_of_the_time():
    """A 2-second compile at share 0.1 lets the next start 20 s after it
    started: compiles take at most a tenth of the time, per time and not per
    task key."""
    now = [100.0]
    budget = CompileBudget(0.1, clock=lambda: now[0])
    assert budget.allows()
    budget.spent(started=100.0, seconds=2.0)
    for now[0] in (102.0, 110.0, 119.9):
        assert not budget.allows()
    now[0] = 120.0
    assert budget.allows()


@pytest.mark.parametrize("proposer_class", [DraftVerifyProposer, AdaDecodeProposer])
def test_state_is_kept_until_a_request_really_finishes(proposer_class):
    """The confidence thresholds of draft_verify and of AdaDecode's base (and
    AdaDecode's rows of the gate's last round)."""
    proposer = proposer_class.__new__(proposer_class)
    proposer.confidence_stop = ConfidenceStop(REFERENCE_RULE)
    if proposer_class is AdaDecodeProposer:
        proposer._round_rows = {"running": 0, "finished": 1}
    for req_id in ("running", "preempted", "finished"):
        proposer.confidence_stop.observe(req_id, accepted=1, drafted=2)
    proposer.forget_finished({"running", "preempted"})  # what vLLM still holds
    assert set(proposer.confidence_stop.requests) == {"running", "preempted"}
    if proposer_class is AdaDecodeProposer:
        assert proposer._round_rows == {"running": 0}


def test_rpc_options_are_validated():
    options = DraftVerifyConfig(method="draft_verify")
    set_option(options, "threshold", 0.3)
    assert options.threshold == 0.3
    with pytest.raises(ValueError, match=r"threshold: 1\.5 is outside \[0, 1\]"):
        set_option(options, "threshold", 1.5)
    assert options.threshold == 0.3  # unchanged after a refused value
    with pytest.raises(ValueError, match=r"threshold: Input should be a valid number"):
        set_option(options, "threshold", "high")
    with pytest.raises(ValueError, match=r"threshold: give a value, not None"):
        set_option(options, "threshold", None)
    assert options.threshold == 0.3
    for name in ("attn_skip", "config_file", "__class__", "method"):
        with pytest.raises(ValueError, match=r"is not an option of draft_verify that can "
                                             r"change while serving"):
            set_option(options, name, [1])
    # The RPC runs the start-up checks of the common fields too.
    with pytest.raises(ValueError, match=r"probe_every: 0 must be >= 1"):
        set_option(options, "probe_every", 0)
    assert options.probe_every == 16


@pytest.mark.parametrize("key, value, message", [
    ("search_seed", -1, r"search_seed: -1 is outside \[0, 4294967296\)"),
    ("search_seed", 2**32, r"search_seed: 4294967296 is outside"),
    ("bayes_kappa", -0.5, r"bayes_kappa: -0.5 must be >= 0")])
def test_swift_search_numbers_are_checked_at_start_up(key, value, message):
    from vllm_selfspec.proposers.swift import SwiftConfig

    with pytest.raises(ValueError, match=message):
        SwiftConfig(method="swift", **{key: value})


def test_swift_search_scores_only_what_can_pay_and_at_a_bounded_share():
    """At draft costs where even a set matching 95 % of tokens loses, the
    search waits; where it pays, it runs until the incumbent is within the
    margin of that best case; each step's cost spaces the next so scoring
    takes at most its share of decoding."""
    from vllm_selfspec.policy.payoff import StepCosts, best_speed
    from vllm_selfspec.policy.skip_search import (
        rounds_until_next_search,
        search_outlook,
    )

    eager = StepCosts(per_draft=0.97, round_overhead=0.1)  # SmolLM2 eager, float32, AVX2
    compiled = StepCosts(per_draft=0.66, round_overhead=0.1)
    assert best_speed(0.95, eager, 25) == 1.0  # drafting never pays: plain speed
    assert search_outlook(None, 0.95, eager, 25, 0.05) == "futile"
    assert search_outlook(0.5, 0.95, compiled, 25, 0.05) == "open"
    assert best_speed(0.95, compiled, 25) > 1.15
    assert search_outlook(0.93, 0.95, compiled, 25, 0.05) == "converged"
    assert search_outlook(0.93, 0.95, StepCosts(per_draft=0.05), 25, 0.05) == "open"
    # A step of 2.6 plain steps at 2 %: the next 130 rounds later; unknown: 1 step.
    assert rounds_until_next_search(2.6, 0.02) == 130
    assert rounds_until_next_search(None, 0.02) == 50
    assert rounds_until_next_search(0.001, 1.0) == 1


def test_an_export_dir_swift_cannot_write_fails_at_start_up(tmp_path):
    from vllm_selfspec.proposers.swift import SwiftConfig

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"export_dir: cannot write into .*a-file/exports"):
        SwiftConfig(method="swift", export_dir=str(blocker / "exports"))
    assert SwiftConfig(method="swift", export_dir=str(tmp_path / "ok")).export_dir


def test_draft_probabilities_one_hot_for_unsampled_drafts_zero_without_a_draft():
    """Row 0 sampled its first draft (q kept), then stopped (NO_DRAFT); row 1
    is greedy: its drafts are one-hot. A position without a draft has q = 0,
    so a pad vLLM verifies leaves the target's own sample."""
    import torch

    from vllm_selfspec.draft.sampling import DraftSampler

    sampler = DraftSampler(torch.tensor([0.8, 0.0]), {}, batch_size=2, max_drafts=2,
                           vocab_size=4)
    drafts = sampler.sample(torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]),
                            positions=torch.tensor([5, 9]))
    assert drafts[1] == 2  # the greedy row drafts its argmax
    sampler.keep(0, torch.tensor([True, True]))
    probs = sampler.round_probs(torch.tensor([[int(drafts[0]), -1], [2, 3]]))
    assert torch.allclose(probs[0, 0], torch.softmax(torch.tensor([2.0, 1, 0, 0]) / 0.8, -1))
    assert probs[0, 1].sum() == 0
    assert probs[1].tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]


def test_sampled_drafts_follow_q_and_seeded_rows_repeat():
    """A sampled row's draft is a draw from q = softmax(logits / T) (tokens
    outside a draft vocabulary, at -inf, never drawn); a seeded row draws the
    same token at the same position whatever else is in the batch, and
    another at another position."""
    import torch

    from vllm_selfspec.draft.sampling import DraftSampler

    rows, logits = 20000, torch.tensor([2.0, 1.0, 0.0, float("-inf")])
    sampler = DraftSampler(torch.full((rows,), 0.8), {}, batch_size=rows, max_drafts=1,
                           vocab_size=4)
    drafts = sampler.sample(logits.repeat(rows, 1), positions=torch.zeros(rows, dtype=torch.long))
    share = torch.bincount(drafts, minlength=4) / rows
    assert torch.allclose(share, torch.softmax(logits / 0.8, -1), atol=0.015), share
    assert share[3] == 0

    flat = torch.zeros(2, 1000)

    def seeded_draw(position: int, other_row: torch.Tensor) -> int:
        sampler = DraftSampler(torch.tensor([1.0, 1.0]), {0: 1234}, batch_size=2,
                               max_drafts=1, vocab_size=1000)
        return int(sampler.sample(torch.stack([flat[0], other_row]),
                                  positions=torch.tensor([position, 3]))[0])

    assert len({seeded_draw(17, torch.randn(1000)) for _ in range(5)}) == 1
    assert len({seeded_draw(position, flat[1]) for position in range(20)}) > 10
