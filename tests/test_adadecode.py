"""AdaDecode on the real engine: lossless greedy and sampling with the shipped
SmolLM2 heads, early exits drafting some tokens and the full-depth draft the
rest, the exit gate learning each head's acceptance and the base's, above
threshold 1 draft_verify's own rounds (none without `full_depth`),
100 % acceptance when the only exit is the last layer, bad heads refused at
start-up, and a training run that lowers held-out KL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import (
    ONE_PROCESS,
    Acceptance,
    assert_every_draft_accepted,
    assert_greedy_parity_with_rejections,
    assert_same_sampling_distribution,
    greedy,
    identity_heads,
    start_engine,
    stop_engine,
)
from tests.test_config import engine_config
from vllm_selfspec.assets import ROOT
from vllm_selfspec.diagnostics import WORKER_EXTENSION

# A low threshold: many early tokens, many of them wrong, so verification
# rejects and rolls back often.
EAGER_EXITS = {"method": "adadecode", "heads": "smollm2-135m", "threshold": 0.4}


@pytest.fixture(scope="module")
def adadecode():
    llm = start_engine(EAGER_EXITS, worker_extension_cls=WORKER_EXTENSION)
    yield llm
    stop_engine(llm)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_output_identical_to_plain_vllm(adadecode, plain_outputs, test_prompts,
                                               batch_size):
    assert_greedy_parity_with_rejections(adadecode, plain_outputs, test_prompts, batch_size)


def test_sampling_keeps_the_target_distribution(adadecode, plain):
    assert_same_sampling_distribution(adadecode, plain)


def test_early_exits_draft_some_tokens_and_full_depth_the_rest(adadecode, plain_outputs,
                                                                test_prompts):
    acceptance = Acceptance()
    outputs = greedy(adadecode, test_prompts[:8], 8, acceptance=acceptance)
    assert outputs == plain_outputs[8][:8]
    sources = acceptance.sources
    assert 0 < sources["mechanism_drafted"] < sources["self_drafted"] == acceptance.drafted, \
        sources
    assert 0 < sources["mechanism_accepted"] < sources["mechanism_drafted"], sources


def test_the_exit_gate_learns_each_heads_acceptance_and_the_bases(adadecode, test_prompts):
    """Verified drafts reach the gate by the head that made them (or the
    base); not cost-aware, every head stays open and no round is a shadow
    round."""
    greedy(adadecode, test_prompts[:8], 16)
    gate = adadecode.collective_rpc("selfspec_exit_gate")[0]
    heads, shadowed, base = gate["reached"][:3], gate["reached"][3:6], gate["reached"][6]
    assert base > 0 and sum(heads) > 0 and sum(shadowed) == 0, gate  # no shadow rounds
    assert 0 < gate["base_acceptance"] <= 1, gate
    assert all(a is None or 0 <= a <= 1 for a in gate["head_acceptance"]), gate
    assert gate["open"] == [True] * 3, gate


def test_with_no_head_exiting_the_rounds_are_draft_verifys(adadecode, plain_outputs,
                                                            test_prompts):
    """Above threshold 1 no head exits: every draft is the full-depth base's,
    and the rounds are `draft_verify`'s at its defaults: as many rounds of
    each length under the same adaptive confidence stop (over the exact
    draft every draft is accepted, so a round's accepted drafts are its
    length)."""
    adadecode.collective_rpc("selfspec_set_option", args=("threshold", 1.01))
    try:
        acceptance = Acceptance()
        outputs = greedy(adadecode, test_prompts[:8], 8, acceptance=acceptance)
    finally:
        adadecode.collective_rpc("selfspec_set_option",
                                 args=("threshold", EAGER_EXITS["threshold"]))
    draft_verify = start_engine({"method": "draft_verify"})
    try:
        base = Acceptance()
        greedy(draft_verify, test_prompts[:8], 8, acceptance=base)
    finally:
        stop_engine(draft_verify)
    assert outputs == plain_outputs[8][:8]
    assert acceptance.accepted == acceptance.drafted > 0, acceptance
    assert acceptance.sources["mechanism_drafted"] == 0, acceptance
    assert acceptance.drafted < 12 * acceptance.rounds, acceptance  # the stop ended rounds
    assert acceptance.rounds_accepting == base.rounds_accepting, (acceptance, base)
    assert len(acceptance.rounds_accepting) > 2, acceptance  # rounds of several lengths


def test_without_full_depth_threshold_above_one_is_plain_decoding(plain_outputs,
                                                                  test_prompts):
    llm = start_engine({**EAGER_EXITS, "threshold": 1.01, "full_depth": False})
    try:
        acceptance = Acceptance()
        outputs = greedy(llm, test_prompts[:8], 8, acceptance=acceptance)
    finally:
        stop_engine(llm)
    assert outputs == plain_outputs[8][:8]
    assert acceptance.drafted == 0


def test_exit_at_the_last_layer_is_always_accepted(model_dir, tmp_path, plain_outputs,
                                                   test_prompts):
    """The only head is the model's own at layer L: every draft is the target's
    own token, so any KV or window bug shows up as a rejection."""
    heads = identity_heads(tmp_path / "last", model_dir, [30])
    llm = start_engine({"method": "adadecode", "heads": str(heads), "threshold": 0.0})
    try:
        assert_every_draft_accepted(llm, plain_outputs, test_prompts)
    finally:
        stop_engine(llm)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        ("missing", r"speculative_config\.heads: no heads at"),
        ("other_model", r"trained for a model with num_hidden_layers=3"),
        ("wrong_shape", r"holds exit\.10\.transform with shape \[576, 575\]"),
        ("other_weights", r"final-norm hash mismatch"),
        ("bad_layer", r"speculative_config\.exit_layers: \[7\] must be a non-empty subset"),
    ],
)
def test_bad_heads_fail_at_start_up(model_dir, tiny_llama_dir, tmp_path, make, message):
    spec = {"method": "adadecode", "heads": str(tmp_path / "heads")}
    if make == "other_model":
        identity_heads(tmp_path / "heads", tiny_llama_dir, [1, 2])
    elif make in ("wrong_shape", "other_weights", "bad_layer"):
        identity_heads(tmp_path / "heads", model_dir, [10])
    if make == "wrong_shape":
        from safetensors.torch import save_file

        save_file({"exit.10.transform": torch.zeros(576, 575)},
                  tmp_path / "heads" / "heads.safetensors")
    if make == "other_weights":
        meta_file = tmp_path / "heads" / "heads.json"
        meta = json.loads(meta_file.read_text())
        meta["model"]["final_norm_sha256"] = "0" * 64
        meta_file.write_text(json.dumps(meta))
    if make == "bad_layer":
        spec["exit_layers"] = [7]
    with pytest.raises(ValueError, match=message):
        engine_config(model_dir, spec)


def test_training_lowers_held_out_kl(tiny_llama_dir, tmp_path):
    out = tmp_path / "heads"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_exit_heads.py"),
         "--model", str(tiny_llama_dir), "--exit-layers", "1,2", "--num-prompts", "4",
         "--max-tokens", "32", "--epochs", "4", "--batch-tokens", "64",
         "--held-out", "0.25", "--out", str(out), "--workdir", str(tmp_path / "work")],
        check=True, cwd=ROOT, timeout=900, env={**os.environ, **ONE_PROCESS},
    )
    meta = json.loads((out / "heads.json").read_text())
    for layer in ("1", "2"):
        result = meta["held_out"][layer]
        assert result["after"]["kl"] < 0.9 * result["before"]["kl"], result
    # The trained heads load and decode on the tiny model.
    spec = {"method": "adadecode", "heads": str(out), "threshold": 0.0}
    engine_config(tiny_llama_dir, spec)
