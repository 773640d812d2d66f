"""Engine-free checks of what a client or an operator can send: SWIFT's task
keys and export paths, the benchmark RPCs' option changes, and the feedback
the adaptive state gets from a round."""

from __future__ import annotations

import pytest

from vllm_selfspec.proposers.base import verified_feedback
from vllm_selfspec.proposers.draft_verify import DraftVerifyConfig, DraftVerifyProposer
from vllm_selfspec.proposers.swift import export_path, task_name
from vllm_selfspec.workers.profiling import set_option


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


def test_feedback_counts_only_verified_drafts():
    """Request a drafted 4 but vLLM scheduled none (prefill chunk, budget):
    it reports 0 rejected, which is no feedback, not 4 accepted. Request b had
    2 of its drafts scheduled and 1 rejected."""
    feedback = verified_feedback(["a", "b", "c"], verified=[0, 2, 3], rejected=[0, 1, 3])
    assert feedback == [("b", 1, 2), ("c", 0, 3)]


def test_state_is_kept_until_a_request_really_finishes():
    proposer = DraftVerifyProposer.__new__(DraftVerifyProposer)
    proposer.thresholds = {"running": None, "preempted": None, "finished": None}
    proposer.forget_finished({"running", "preempted"})  # what vLLM still holds
    assert set(proposer.thresholds) == {"running", "preempted"}


def test_rpc_options_are_validated():
    options = DraftVerifyConfig(method="draft_verify")
    set_option(options, "threshold", 0.3)
    assert options.threshold == 0.3
    with pytest.raises(ValueError, match=r"threshold: 1\.5 is outside \[0, 1\]"):
        set_option(options, "threshold", 1.5)
    assert options.threshold == 0.3  # unchanged after a refused value
    with pytest.raises(ValueError, match=r"threshold: Input should be a valid number"):
        set_option(options, "threshold", "high")
    for name in ("attn_skip", "config_file", "__class__", "method"):
        with pytest.raises(ValueError, match=r"is not an option of draft_verify that can "
                                             r"change while serving"):
            set_option(options, name, [1])
