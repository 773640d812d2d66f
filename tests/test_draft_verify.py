"""Draft & Verify on the real engine: lossless greedy and sampling, full-depth
acceptance, chunked prefill, prefix caching and KV block boundaries. The
skip-set engine has lookup drafts on (shared with test_lookup.py), so its
parity covers requests that look up and requests that self-draft in one batch.

Engines run SmolLM2-135M in float32 with 32-token KV blocks and a 256-token
batch budget, so the 32 generated tokens cross a block boundary and prompts longer
than 256 tokens prefill in chunks while other requests decode.
"""

from __future__ import annotations

import pytest

from tests.conftest import (
    PARITY_TOKENS,
    Acceptance,
    assert_every_draft_accepted,
    assert_greedy_parity_with_rejections,
    assert_same_sampling_distribution,
    greedy,
    start_engine,
    stop_engine,
)
from vllm_selfspec.workers.profiling import WORKER_EXTENSION

FULL_DEPTH = {"method": "draft_verify", "num_speculative_tokens": 4,
              "adaptive_threshold": False, "threshold": 0.0}


@pytest.fixture(scope="module")
def full_depth():
    llm = start_engine(FULL_DEPTH)
    yield llm
    stop_engine(llm)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_output_identical_to_plain_vllm(skip_set_with_lookup, plain_outputs,
                                               test_prompts, batch_size):
    assert_greedy_parity_with_rejections(skip_set_with_lookup, plain_outputs, test_prompts,
                                         batch_size)


def test_full_depth_drafts_are_all_accepted(full_depth, plain_outputs, test_prompts):
    assert_every_draft_accepted(full_depth, plain_outputs, test_prompts)


def test_prefix_cache_hits_keep_outputs(skip_set_with_lookup, plain_outputs, test_prompts):
    """Prompts sharing long prefixes, run again once the cache holds them."""
    from vllm import SamplingParams

    shared = [p + suffix for p in test_prompts[-2:] for suffix in ("", "\n", "\n\n")]
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_TOKENS, ignore_eos=True)
    first = skip_set_with_lookup.generate(shared, params, use_tqdm=False)
    second = skip_set_with_lookup.generate(shared, params, use_tqdm=False)
    assert all(output.num_cached_tokens >= 128 for output in second)
    texts = [output.outputs[0].text for output in second]
    assert texts == [output.outputs[0].text for output in first]
    assert texts[0] == plain_outputs[8][-2] and texts[3] == plain_outputs[8][-1]


def test_sampling_keeps_the_target_distribution_also_after_rejections(skip_set_with_lookup,
                                                                       plain):
    assert_same_sampling_distribution(skip_set_with_lookup, plain, after_rejections=True)


def test_cost_aware_drafting_declines_where_drafts_lose(plain_outputs, test_prompts):
    """A draft through layer 0 alone is cheap but seldom right: the budget
    drafts at most a token where a request's own record says it may pay and
    probes the others every 8th round, so requests draft a small fraction of
    what forced drafting would and some rounds run no draft forward at all;
    outputs stay plain vLLM's. The budget's prior (profiling-mode costs) is
    timed at start-up, before any request."""
    spec = {"method": "draft_verify", "num_speculative_tokens": 4, "cost_aware": True,
            "probe_every": 8, "attn_skip": list(range(1, 30)), "mlp_skip": list(range(1, 30))}
    llm = start_engine(spec, worker_extension_cls=WORKER_EXTENSION)
    try:
        (at_start_up,) = llm.collective_rpc("selfspec_round_costs")
        acceptance = Acceptance()
        outputs = greedy(llm, test_prompts[:8], 8, acceptance=acceptance)
        (counters,) = llm.collective_rpc("selfspec_counters")
        (state,) = llm.collective_rpc("selfspec_state")
    finally:
        stop_engine(llm)
    assert at_start_up["prior"]["per_draft"] > 0, at_start_up
    assert outputs == plain_outputs[8][:8]
    assert 0 < counters["draft_steps"] < counters["rounds"], counters
    # Forced, it drafts 4 tokens a round (about 200 here); the budget
    # keeps to about one token a request-round or none (the first rounds, before
    # the engine's record says the draft loses, and probes).
    assert 0 < acceptance.drafted < 8 * PARITY_TOKENS / 2, acceptance
    assert acceptance.drafted <= 1.2 * acceptance.rounds, acceptance
    assert state["requests_with_state"]["self_records"] <= 8
