"""Lookup drafts on the real engine: a request whose output copies its prompt
drafts from its own text, one that does not self-drafts, each request's
summary says where its tokens came from, and outputs stay plain vLLM's (at
batch 1 and 8 in test_draft_verify.py, on the same engine). With the suffix
source (Arctic Inference's trees), a request that repeats an earlier one's
answer drafts it from the cache of past responses, which stays bounded, and
sampled requests drafting from each other's answers keep the target's
distribution."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import (
    Acceptance,
    assert_same_sampling_distribution,
    greedy,
    start_engine,
    stop_engine,
)
from vllm_selfspec.diagnostics import WORKER_EXTENSION

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


def suffix_lookup(max_cached_requests: int = 4):
    from vllm_selfspec.config import LOOKUP_DEFAULTS
    from vllm_selfspec.draft.lookup import make_lookup

    settings = {**LOOKUP_DEFAULTS, "source": "suffix",
                "max_cached_requests": max_cached_requests}
    return make_lookup(settings, max_model_len=1000)


def test_each_lookup_source_drafts_through_one_interface():
    """The `lookup` option makes its source (none when off): the n-gram
    matcher, stateless and sized by the request's record, or the suffix
    trees, which estimate each prefix's chance of acceptance (falling along
    the draft) and hold a tree per live request until it is forgotten."""
    from vllm_selfspec.config import LOOKUP_DEFAULTS
    from vllm_selfspec.draft.lookup import NgramLookup, SuffixLookup, make_lookup

    assert make_lookup(None, 1000) is None and make_lookup({}, 1000) is None
    ngram = make_lookup({**LOOKUP_DEFAULTS, "source": "ngram"}, 1000)
    assert isinstance(ngram, NgramLookup) and not ngram.sizes_drafts
    context = np.asarray([1, 2, 3, 4, 9, 1, 2, 3], dtype=np.int32)
    found = ngram.drafts(iter([(0, "a", context), (1, "b", context)]), [2, 0],
                         np.array([3, 3]))
    assert {row: draft.tokens.tolist() for row, draft in found.items()} == {0: [4, 9]}
    assert found[0].path_probabilities is None
    assert ngram.per_request_state() == {}
    suffix = suffix_lookup()
    assert isinstance(suffix, SuffixLookup) and suffix.sizes_drafts
    context = np.asarray([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], dtype=np.int32)
    draft = suffix.drafts(iter([(0, "a", context)]), [4], np.array([len(context)]))[0]
    assert draft.tokens.tolist()[0] in (4, 5)
    probabilities = draft.path_probabilities
    assert len(probabilities) == len(draft.tokens) and 0 < probabilities[0] <= 1
    assert probabilities == sorted(probabilities, reverse=True)
    assert suffix.per_request_state() == {"suffix_trees": 1}
    suffix.forget(set())
    assert suffix.per_request_state() == {"suffix_trees": 0}


def one_request(lookup, req_id: str, prompt: list[int], output: list[int], length: int = 4):
    """Feed a request's prompt and output, one token per step, and return
    the draft proposed after the last one."""
    found = {}
    for end in range(1, len(output) + 1):
        context = np.asarray(prompt + output[:end], dtype=np.int32)
        found = lookup.drafts(iter([(0, req_id, context)]), [length], np.array([len(prompt)]))
    return found[0].tokens.tolist() if 0 in found else []


def test_the_suffix_source_drafts_another_requests_answer_and_stays_bounded():
    lookup = suffix_lookup(max_cached_requests=2)
    answer = [11, 12, 13, 14, 15, 16, 17, 18]
    one_request(lookup, "a", [1, 2, 3], answer)
    lookup.forget(set())  # "a" finished: its tree goes, its answer stays cached
    assert lookup.fed == {} and list(lookup.cache.active_requests) == []
    # Another prompt whose answer starts like "a"'s: the rest is drafted from it.
    assert one_request(lookup, "b", [7, 8, 9], answer[:4]) == answer[4:8]
    for index in range(5):
        one_request(lookup, f"more-{index}", [index], [40 + index, 41 + index])
    lookup.forget(set())
    assert len(lookup.cache.cached_requests) == 2  # max_cached_requests
    assert lookup.describe()["cached_responses"] == 2


def test_the_suffix_source_drafts_from_the_requests_own_prompt_and_restarts_cleanly():
    lookup = suffix_lookup(max_cached_requests=0)  # no past responses
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    # A match of 3 tokens drafts at most 3 (max_spec_factor 1).
    assert one_request(lookup, "a", prompt, [5, 6, 7]) == [8, 9, 10]
    # The same id with fewer tokens (vLLM recomputed it): its tree is rebuilt.
    assert one_request(lookup, "a", [1, 2], [3]) == []
    assert lookup.fed == {"a": 3}


@pytest.fixture(scope="module")
def suffix_lookups():
    """The recommended draft with suffix lookups (a fresh cache of past
    responses: the first test in this module to use it counts on that)."""
    llm = start_engine({"method": "draft_verify", "lookup": {"source": "suffix"}},
                       worker_extension_cls=WORKER_EXTENSION)
    yield llm
    stop_engine(llm)


def test_suffix_lookup_keeps_greedy_parity_and_drafts_a_repeated_answer(suffix_lookups,
                                                                       plain,
                                                                       test_prompts):
    """Outputs are plain vLLM's, and a prompt asked again drafts its answer
    from the first one's."""
    llm = suffix_lookups
    prompts = test_prompts[:4]
    assert greedy(llm, prompts, 4, max_tokens=32) == greedy(plain, prompts, 4,
                                                             max_tokens=32)
    again = Acceptance()
    assert greedy(llm, prompts[:1], 1, max_tokens=32, acceptance=again) == greedy(
        plain, prompts[:1], 1, max_tokens=32)
    (state,) = llm.collective_rpc("selfspec_state")
    sources = again.sources
    assert sources["lookup_drafted"] >= 16, sources
    assert sources["lookup_accepted"] / sources["lookup_drafted"] > 0.8, sources
    # Five requests ran; a tree is held only while vLLM holds its request (the
    # last one's goes at the next round, as every per-request state does).
    assert state["requests_with_state"]["suffix_trees"] <= 1, state


def test_suffix_lookup_keeps_the_target_distribution_also_after_rejections(suffix_lookups,
                                                                          plain):
    """Hundreds of sampled requests of one prompt: each later one drafts from
    the earlier ones' answers in the cache of past responses, which its own
    samples often leave (rejected, resampled from the remainder); the tokens
    before and after those rejections keep the target's distribution. A seeded
    request drawn again drafts from more answers than the first time, so its
    text may differ (README, "Seeded sampling"), as with vLLM's `suffix`."""
    acceptance = assert_same_sampling_distribution(suffix_lookups, plain,
                                                   after_rejections=True,
                                                   reproducible=False)
    sources = acceptance.sources
    assert sources["lookup_drafted"] > sources["lookup_accepted"] > 0, sources
