"""Lookup drafts on the real engine: a request whose output copies its prompt
drafts from its own text, one that does not self-drafts, each request's
summary says where its tokens came from, and outputs stay plain vLLM's (at
batch 1 and 8 in test_draft_verify.py, on the same engine)."""

from __future__ import annotations

from tests.conftest import Acceptance, greedy

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
           "begins with a single step. All that glitters is not gold. ")
COPY = f"Repeat the text three times.\n{PASSAGE}\n{PASSAGE}\n"


def test_lookup_drafts_continue_an_earlier_match():
    """(Here, not in an engine-free module: it loads numba, which vLLM-CPU's
    kernel-override scan in test_patches.py cannot walk past.)"""
    import numpy as np

    from vllm_selfspec.draft.lookup import lookup_draft, request_tokens

    recorded = np.array([5, 1, 2, 3, 4, 9, 9, 1], dtype=np.int32)
    # This step verified [1, 2, 7] (input row 10 onward), kept the draft 2, sampled 3.
    tokens = request_tokens(recorded, [0] * 10 + [1, 2, 7], first_row=10, accepted=1,
                            next_token=3)
    assert tokens.tolist() == [5, 1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert lookup_draft(tokens, 3, 8, 100, 3).tolist() == [4, 9, 9]  # after "1 2 3"
    assert len(lookup_draft(tokens, 4, 8, 100, 3)) == 0  # the match is only 3 long


def test_the_matcher_is_compiled_at_start_up_for_vllms_token_dtype():
    """The proposer compiles vLLM's numba matcher when it loads, for the dtype
    of vLLM's token record, so no request pays the compile (a fresh process:
    this one's matcher may be compiled already)."""
    import subprocess
    import sys

    script = ("import torch\n"
              "from vllm.v1.spec_decode.ngram_proposer import "
              "_find_longest_matched_ngram_and_propose_tokens as matcher\n"
              "from vllm.v1.worker.gpu_input_batch import InputBatch\n"
              "from vllm_selfspec.draft.lookup import compile_lookup\n"
              "assert not matcher.signatures\n"
              "compile_lookup(100)\n"
              "batch = InputBatch(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8,\n"
              "                   device=torch.device('cpu'), vocab_size=10,\n"
              "                   block_sizes=[16], max_num_blocks_per_req=[1])\n"
              "print(matcher.signatures[0][0].dtype, batch.token_ids_cpu.dtype)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled, recorded = done.stdout.split()[-2:]
    assert compiled == recorded


def test_a_copying_request_drafts_from_its_own_text(skip_set_with_lookup, plain):
    """...and its per-request summary says so, adding up to vLLM's own counts."""
    acceptance = Acceptance()
    (copied,) = greedy(skip_set_with_lookup, [COPY], 1, max_tokens=64,
                       acceptance=acceptance)
    assert copied == greedy(plain, [COPY], 1, max_tokens=64)[0]
    sources = acceptance.sources
    assert sources["lookup_rounds"] >= 5, sources
    assert sources["lookup_accepted"] / sources["lookup_drafted"] > 0.6, sources
    assert sources["self_drafted"] + sources["lookup_drafted"] == acceptance.drafted
    assert sources["self_accepted"] + sources["lookup_accepted"] == acceptance.accepted
    assert sources["self_rounds"] + sources["lookup_rounds"] >= acceptance.rounds


def test_a_request_without_repeats_self_drafts(skip_set_with_lookup, plain):
    """Rounds draft (the test engines draft whatever it costs; this skip set
    stops a round's drafts early where the draft is unsure) and none finds a
    match, so every draft is a self-draft."""
    prompt = "Name a colour:"
    acceptance = Acceptance()
    (text,) = greedy(skip_set_with_lookup, [prompt], 1, max_tokens=12,
                     acceptance=acceptance)
    assert text == greedy(plain, [prompt], 1, max_tokens=12)[0]
    sources = acceptance.sources
    assert sources["lookup_rounds"] == 0, sources
    assert sources["self_rounds"] >= 3, sources
    assert sources["self_drafted"] == acceptance.drafted >= 3, (sources, acceptance)
