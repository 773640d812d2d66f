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
from vllm_selfspec.diagnostics import WORKER_EXTENSION

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


def test_a_request_at_max_model_len_makes_no_request_draft_zeros(full_depth, plain,
                                                                 test_prompts):
    """Once one request's length plus k passes max_model_len, vLLM skips the
    drafter for the whole step and fills every row with token 0. Those steps
    must draft nothing: shipped as drafts, the zeros would be rejected, which
    full-depth drafting (every real draft accepted) shows at once."""
    from vllm import SamplingParams

    max_model_len = full_depth.llm_engine.model_config.max_model_len
    tokenizer = full_depth.get_tokenizer()
    long_ids = tokenizer(test_prompts[0]).input_ids
    long_ids = (long_ids * (max_model_len // len(long_ids) + 1))[:max_model_len - 24]
    prompts = [{"prompt_token_ids": long_ids}, *test_prompts[1:8]]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    ours = full_depth.generate(prompts, params, use_tqdm=False)
    reference = plain.generate(prompts, params, use_tqdm=False)
    assert ours[0].outputs[0].finish_reason == "length"
    assert len(ours[0].outputs[0].token_ids) == 24  # it ran to max_model_len
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in reference]
    acceptance = Acceptance()
    for output in ours:
        acceptance.add(output)
    assert acceptance.drafted >= 0.6 * 7 * 96, acceptance
    assert acceptance.accepted == acceptance.drafted, acceptance


def test_sampled_requests_keep_full_depth_acceptance(full_depth, plain):
    """Drafts drawn from the draft's own distribution (the default
    draft_sample_method) are accepted with min(1, p/q): at full depth in float32
    q is the target's p, so nearly every sampled draft is kept, where one-hot
    drafts would be kept only with the target's probability of them; and the
    sampled tokens keep the target distribution."""
    from vllm import SamplingParams

    prompts = ["The weather today is", "Once upon a time", "def fibonacci(n):"] * 8
    params = [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True,
                             seed=None if index % 2 else index)
              for index in range(len(prompts))]
    acceptance = Acceptance()
    for output in full_depth.generate(prompts, params, use_tqdm=False):
        acceptance.add(output)
    assert acceptance.drafted >= 0.6 * len(prompts) * 24, acceptance
    assert acceptance.accepted >= 0.97 * acceptance.drafted, acceptance
    assert_same_sampling_distribution(full_depth, plain)


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


def test_max_tokens_1_and_prompt_logprobs_are_plain_vllms(skip_set_with_lookup, plain,
                                                         test_prompts):
    """Requests of one token (no round ever verifies a draft) beside longer
    ones, and prompt and sample logprobs with drafts on: the same tokens,
    logprobs within float32 rounding."""
    from vllm import SamplingParams

    prompts = test_prompts[:6]
    params = [SamplingParams(temperature=0.0, max_tokens=1 if index % 2 else PARITY_TOKENS,
                             ignore_eos=True, logprobs=2, prompt_logprobs=2)
              for index in range(len(prompts))]
    ours = skip_set_with_lookup.generate(prompts, params, use_tqdm=False)
    reference = plain.generate(prompts, params, use_tqdm=False)
    acceptance = Acceptance()
    for mine, theirs in zip(ours, reference):
        acceptance.add(mine)
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        for got, want in zip([*mine.prompt_logprobs[1:], *mine.outputs[0].logprobs],
                             [*theirs.prompt_logprobs[1:], *theirs.outputs[0].logprobs]):
            assert got.keys() == want.keys()
            for token, logprob in want.items():
                assert got[token].logprob == pytest.approx(logprob.logprob, abs=1e-3)
    assert [len(o.outputs[0].token_ids) for o in ours[1::2]] == [1, 1, 1]
    assert acceptance.drafted > 0, acceptance  # the long requests drafted


def test_penalties_keep_greedy_parity(skip_set_with_lookup, plain, test_prompts):
    """Repetition, presence and frequency penalties apply to the target's
    logits at every verified position as at a plain step."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=PARITY_TOKENS, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.3)
    prompts = test_prompts[:8]
    acceptance = Acceptance()
    ours = skip_set_with_lookup.generate(prompts, params, use_tqdm=False)
    for output in ours:
        acceptance.add(output)
    reference = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in reference]
    assert acceptance.drafted > acceptance.accepted > 0, acceptance


def test_sampling_options_keep_the_target_distribution(skip_set_with_lookup, plain):
    """Top-k, top-p, penalties and n=2 in one sampled run, tested after
    rejections too (penalties act on what was generated, and each of a
    request's completions drafts and is verified on its own)."""
    assert_same_sampling_distribution(skip_set_with_lookup, plain, after_rejections=True,
                                      top_k=20, top_p=0.9, repetition_penalty=1.3,
                                      frequency_penalty=0.3, n=2)


def test_a_seeded_request_returns_the_same_text_under_any_load(skip_set_with_lookup,
                                                               test_prompts):
    """With cost_aware off (what the test engines run; README, "Seeded
    sampling"), every request drafts the same whatever shares its batch, so one
    seeded request alone, beside 3 others and beside 15 returns one text."""
    from vllm import SamplingParams

    seeded = SamplingParams(temperature=0.8, max_tokens=40, seed=7, ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True)
    texts = set()
    for company in (0, 3, 15, 0, 7):
        outputs = skip_set_with_lookup.generate(
            [test_prompts[2], *test_prompts[3:3 + company]],
            [seeded, *[others] * company], use_tqdm=False)
        texts.add(outputs[0].outputs[0].text)
    assert len(texts) == 1, texts


def test_cost_aware_drafting_declines_where_drafts_lose(plain_outputs, test_prompts):
    """A draft through layer 0 alone is cheap but seldom right: the budget
    drafts at most a token where a request's own record says it may pay and
    probes the others every 8th round, so requests draft a small fraction of
    what forced drafting would and some rounds run no draft forward at all;
    outputs stay plain vLLM's. The budget's prior (profiling-mode costs) is
    timed at start-up, before any request. (The skip set drafts every round
    it drafts: no full-depth base to fall back on.)"""
    spec = {"method": "draft_verify", "num_speculative_tokens": 4, "cost_aware": True,
            "probe_every": 8, "attn_skip": list(range(1, 30)), "mlp_skip": list(range(1, 30)),
            "full_depth": False}
    llm = start_engine(spec, worker_extension_cls=WORKER_EXTENSION)
    try:
        (at_start_up,) = llm.collective_rpc("selfspec_round_costs")
        acceptance = Acceptance()
        outputs = greedy(llm, test_prompts[:8], 8, acceptance=acceptance)
        (counters,) = llm.collective_rpc("selfspec_counters")
        (state,) = llm.collective_rpc("selfspec_state")
    finally:
        stop_engine(llm)
    times = at_start_up["forward_times"]
    # Timed at every batch size the grid holds, each forward longer than none.
    assert min(times["target_ms_by_tokens"].values()) > 0, at_start_up
    assert min(times["draft_ms_by_batch"].values()) > 0, at_start_up
    assert outputs == plain_outputs[8][:8]
    assert 0 < counters["draft_steps"] < counters["rounds"], counters
    # Forced, it drafts 4 tokens a round (about 200 here); the budget
    # keeps to about one token a request-round or none (the first rounds, before
    # the engine's record says the draft loses, and probes).
    assert 0 < acceptance.drafted < 8 * PARITY_TOKENS / 2, acceptance
    assert acceptance.drafted <= 1.2 * acceptance.rounds, acceptance
    assert state["requests_with_state"]["self_records"] <= 8
