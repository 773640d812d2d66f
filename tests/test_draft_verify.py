"""Draft & Verify on the real engine: lossless greedy and sampling, full-depth
acceptance, chunked prefill, prefix caching and KV block boundaries.

Engines run SmolLM2-135M in float32 with 32-token KV blocks and a 128-token
batch budget, so 48 generated tokens cross block boundaries and prompts longer
than 128 tokens prefill in chunks while other requests decode.
"""

from __future__ import annotations

import collections

import pytest
from scipy.stats import chi2_contingency

from tests.conftest import Acceptance, greedy, start_engine, stop_engine
from vllm_selfspec import prompts

# A skip set in the spirit of the shipped searched one: drafts are often wrong,
# so verification rejects and rolls back a lot.
SKIPPING = {"method": "draft_verify", "num_speculative_tokens": 4,
            "attn_skip": [5, 9, 13, 17, 21, 25], "mlp_skip": [8, 14, 20, 26]}
FULL_DEPTH = {"method": "draft_verify", "num_speculative_tokens": 4,
              "adaptive_threshold": False, "threshold": 0.0}


@pytest.fixture(scope="module")
def test_prompts(model_dir) -> list[str]:
    # 24 prompts, 25 to ~600 tokens: code, chat questions, and two long ones
    # that exceed the 128-token budget (chunked prefill).
    mixed = prompts.mixed(22)
    long_code = "\n".join(prompts.humaneval(12)[8:12])
    return [*mixed, long_code, long_code + "\n# And a test:\n"]


def _engine(spec):
    llm = start_engine(spec)
    yield llm
    stop_engine(llm)


@pytest.fixture(scope="module")
def plain():
    yield from _engine(None)


@pytest.fixture(scope="module")
def skipping():
    yield from _engine(SKIPPING)


@pytest.fixture(scope="module")
def full_depth():
    yield from _engine(FULL_DEPTH)


@pytest.fixture(scope="module")
def plain_outputs(plain, test_prompts):
    return {size: greedy(plain, test_prompts, size) for size in (1, 8)}


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_output_identical_to_plain_vllm(skipping, plain_outputs, test_prompts,
                                               batch_size):
    acceptance = Acceptance()
    outputs = greedy(skipping, test_prompts, batch_size, acceptance=acceptance)
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, plain_outputs[batch_size]))
                  if a != b]
    assert not mismatched, f"prompts {mismatched} differ from plain vLLM"
    # The skip set must really draft, and verification must really reject.
    assert acceptance.drafted > 100
    assert 0 < acceptance.accepted < acceptance.drafted


def test_full_depth_drafts_are_all_accepted(full_depth, plain_outputs, test_prompts):
    acceptance = Acceptance()
    outputs = greedy(full_depth, test_prompts, 8, acceptance=acceptance)
    assert outputs == plain_outputs[8]
    assert acceptance.drafted >= 900
    assert acceptance.accepted == acceptance.drafted, acceptance


def test_prefix_cache_hits_keep_outputs(skipping, plain_outputs, test_prompts):
    """Prompts sharing long prefixes, run again once the cache holds them."""
    from vllm import SamplingParams

    shared = [p + suffix for p in test_prompts[-2:] for suffix in ("", "\n", "\n\n")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    first = skipping.generate(shared, params, use_tqdm=False)
    second = skipping.generate(shared, params, use_tqdm=False)
    assert all(output.num_cached_tokens >= 128 for output in second)
    texts = [output.outputs[0].text for output in second]
    assert texts == [output.outputs[0].text for output in first]
    assert texts[0] == plain_outputs[8][-2] and texts[3] == plain_outputs[8][-1]


def _second_and_third_tokens(llm, prompt: str, samples: int) -> list[tuple[int, int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.8, max_tokens=3, seed=seed, ignore_eos=True)
              for seed in range(samples)]
    outputs = llm.generate([prompt] * samples, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[1:3]) for o in outputs]


def test_sampling_keeps_the_target_distribution(plain, skipping):
    """Chi-square test of the 2nd and 3rd sampled tokens, which speculation
    produces through draft verification (the 1st comes from the prefill)."""
    prompt = "My favourite animal is the"
    samples = 600
    ours = _second_and_third_tokens(skipping, prompt, samples)
    reference = _second_and_third_tokens(plain, prompt, samples)
    for position in (0, 1):
        table = _contingency([t[position] for t in ours],
                             [t[position] for t in reference])
        assert len(table[0]) >= 3, "prompt too peaked for a meaningful test"
        p_value = chi2_contingency(table).pvalue
        assert p_value > 1e-3, f"token {position + 2} distribution differs (p={p_value})"


def _contingency(first: list[int], second: list[int]) -> list[list[int]]:
    """Counts per token, tokens rarer than 10 in total merged into one column."""
    total = collections.Counter(first) + collections.Counter(second)
    common = [token for token, count in total.items() if count >= 10]
    rows = []
    for sample in (first, second):
        counts = collections.Counter(t if t in common else -1 for t in sample)
        rows.append([counts[token] for token in [*common, -1]])
    return rows
