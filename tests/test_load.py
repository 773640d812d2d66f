"""A real `vllm serve` under load, faults and bad input (scripts/load_test.py,
shortened): 32 concurrent clients, mixed greedy / sampled / streamed / n=2 /
logprobs / constrained requests, long prompts, disconnects and aborts, bad
requests, and a KV cache small enough to preempt. Plain vLLM first, then
AdaDecode (whose deferred layers carry KV work across steps, the state most
exposed to preemption and aborts)."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import forced


@pytest.fixture(scope="module")
def reports(model_dir, tmp_path_factory):
    from bench.presets import settings_for
    from load_test import build_requests, load_run, server_args
    from serving import vllm_serve
    from transformers import AutoTokenizer

    args = argparse.Namespace(clients=32, duration=25, max_num_seqs=32, kv_blocks=64)
    plan = build_requests(200, str(model_dir), AutoTokenizer.from_pretrained(model_dir))
    logs = tmp_path_factory.mktemp("load")
    found, reference = {}, None
    for name, spec in (("plain", None), ("adadecode", forced(settings_for(model_dir.name)["adadecode"]))):
        with vllm_serve(model_dir, spec, logs / f"{name}.log", server_args(args),
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, dev_mode=True) as server:
            found[name], greedy = load_run(server, name, plan, args, reference)
        reference = reference or greedy
    return found


@pytest.mark.parametrize("name", ["plain", "adadecode"])
def test_no_server_errors_under_load(reports, name):
    report = reports[name]
    assert report.requests >= 40
    assert report.by_status.get("error", 0) == 0, "\n".join(
        f"request {e['index']} ({e['kind']}, {e['seconds']:.3f} s): {e['detail']}"
        for e in report.errors)
    for status in ("ok", "rejected", "cut"):  # every kind of traffic happened
        assert report.by_status.get(status, 0) > 0, report.by_status
    assert report.preemptions > 0  # the small KV cache really forced preemption
    assert report.healthy_after


def test_greedy_answers_equal_plain_vllm(reports):
    report = reports["adadecode"]
    assert report.greedy_compared >= 25
    assert report.greedy_identical == report.greedy_compared, report.mismatched
    assert report.acceptance is not None and report.acceptance > 0


def test_per_request_state_is_released(reports):
    """After the run, at most the last batch's requests hold state; after one
    more request, at most that one."""
    report = reports["adadecode"]
    for rank in report.state_after_run:
        assert all(n <= 32 for n in rank["requests_with_state"].values()), rank
    for rank in report.state_after_one_more:
        assert all(n <= 1 for n in rank["requests_with_state"].values()), rank
