"""SWIFT's skip-set search without an engine (`policy/skip_search.py`)."""

import pytest

from vllm_selfspec.policy.skip_search import SearchSettings, SkipSetSearch


def search(bayes_interval: int) -> SkipSetSearch:
    return SkipSetSearch(12, SearchSettings(ratio=0.4, bayes_interval=bayes_interval, kappa=2.5,
                                            stop_matchness=0.99, max_tolerance=50,
                                            max_iterations=100, seed=0))


@pytest.mark.parametrize("bayes_interval", [0, 3])
def test_the_gaussian_process_is_built_only_for_bayesian_suggestions(bayes_interval):
    """With `bayes_interval` 0 (random candidates only, allowed without the
    bayesian-optimization package) scoring candidates builds no optimiser;
    with Bayesian suggestions every scored candidate is registered once."""
    found = search(bayes_interval)
    found.incumbent_score = 0.0
    scored = []
    for score in (0.1, 0.3, 0.2, 0.4, 0.25):
        candidate = found.next_candidate()
        found.record(candidate, score)
        scored.append(candidate)
    assert found.iterations == 5 and found.incumbent_score == 0.4
    if bayes_interval == 0:
        assert found._optimizer is None
    else:
        assert len(found.optimizer.space) == len(set(scored))
