"""`vllm serve` on loopback: the documented command works, answers
OpenAI-compatible requests, counts our drafts on /metrics, and survives bad
requests. Two methods here, one of each family (a skip set, and SWIFT with its
per-request task key); the others are served in test_load.py (AdaDecode, under
load, faults and bad input) and, with all four, in scripts/load_test.py."""

from __future__ import annotations

import pytest
import requests

from tests.conftest import forced

SPECS = {
    "draft_verify": {"method": "draft_verify", "config_file": "smollm2-135m"},
    "swift": {"method": "swift", "context_window": 8},
}


@pytest.fixture(scope="module", params=list(SPECS))
def server(request, model_dir, tmp_path_factory):
    from serving import vllm_serve

    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--block-size", "32", "--max-num-seqs", "8",
            "--per-request-spec-decode-metrics", "summary"]
    log = tmp_path_factory.mktemp("server") / "serve.log"
    try:
        with vllm_serve(model_dir, forced(SPECS[request.param]), log, args,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, start_timeout=300) as running:
            yield running
    except RuntimeError as error:
        pytest.fail(str(error))


CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def plain_answers(plain):
    """Plain vLLM's greedy answers (offline engine, same float32 model) to the
    requests below: what every server must send back, token for token."""
    from vllm import SamplingParams

    def text(outputs) -> str:
        return outputs[0].outputs[0].text

    greedy = {n: SamplingParams(temperature=0.0, max_tokens=n) for n in (24, 32)}
    return {"completion": text(plain.generate(["def fibonacci(n):"], greedy[32],
                                              use_tqdm=False)),
            "stream": text(plain.generate(["1, 2, 3,"], greedy[24], use_tqdm=False)),
            "chat": text(plain.chat(CHAT, greedy[24], use_tqdm=False))}


def test_completion_and_chat_equal_plain_vllm(server, model_dir, plain_answers):
    completion = requests.post(f"{server.url}/v1/completions", json={
        "model": str(model_dir), "prompt": "def fibonacci(n):", "max_tokens": 32,
        "temperature": 0, "vllm_xargs": {"selfspec_task": "code"}}, timeout=120).json()
    assert completion["choices"][0]["text"] == plain_answers["completion"]
    chat = requests.post(f"{server.url}/v1/chat/completions", json={
        "model": str(model_dir), "max_tokens": 24, "temperature": 0, "messages": CHAT},
        timeout=120).json()
    assert chat["choices"][0]["message"]["content"] == plain_answers["chat"]


def test_eight_clients_at_once_get_plain_vllms_answers(server, model_dir, plain_outputs,
                                                       test_prompts):
    """Eight requests in flight together (the server's whole batch: rounds
    verify drafts of several requests at once, long prompts prefill in chunks
    beside decodes), each answered token for token as plain vLLM answers it."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import PARITY_TOKENS

    def complete(prompt: str) -> str:
        return requests.post(f"{server.url}/v1/completions", json={
            "model": str(model_dir), "prompt": prompt, "max_tokens": PARITY_TOKENS,
            "temperature": 0, "ignore_eos": True}, timeout=300).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(complete, test_prompts[:8]))
    assert answers == plain_outputs[8][:8]


def test_streaming_assembles_to_plain_vllm(server, model_dir, plain_answers):
    import json

    with requests.post(f"{server.url}/v1/completions", json={
            "model": str(model_dir), "prompt": "1, 2, 3,", "max_tokens": 24,
            "temperature": 0, "stream": True}, stream=True, timeout=120) as response:
        chunks = [json.loads(line[len(b"data: "):]) for line in response.iter_lines()
                  if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain_answers["stream"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_metrics_count_our_drafts(server, model_dir):
    """vLLM's counters and ours by source on /metrics, and the response's
    per-request summary: all self-drafted here (no lookup configured)."""
    def counters() -> list[float]:  # one scrape, so all from the same steps
        scrape = requests.get(f"{server.url}/metrics", timeout=30).text
        return [*server.spec_counters(scrape),
                server.metric("vllm:selfspec_draft_tokens_total", scrape, source="self"),
                server.metric("vllm:selfspec_accepted_tokens_total", scrape, source="self")]

    before = counters()
    answer = requests.post(f"{server.url}/v1/completions", json={
        "model": str(model_dir), "prompt": "for i in range(10):", "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}, timeout=120).json()
    drafted, accepted, _, self_drafted, self_accepted = (
        b - a for a, b in zip(before, counters()))
    assert drafted > 0 and accepted > 0
    assert (self_drafted, self_accepted) == (drafted, accepted)
    summary = answer["metrics"]["speculative_decoding"]
    sources = summary["token_sources"]
    assert sources["self_drafted"] == summary["num_draft_tokens"], summary
    assert sources["self_accepted"] == summary["num_accepted_draft_tokens"], summary
    assert sources["self_rounds"] >= summary["num_spec_steps"] and "lookup_rounds" not in sources


def test_bad_requests_get_4xx_and_server_keeps_serving(server, model_dir):
    bad = [
        {"model": str(model_dir), "prompt": "hi", "temperature": -1},
        {"model": str(model_dir), "prompt": "hi", "max_tokens": 5000},
        {"model": str(model_dir), "prompt": "hi " * 2000, "max_tokens": 8},
    ]
    for body in bad:
        response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert 400 <= response.status_code < 500, (body, response.text[:300])
    response = requests.post(f"{server.url}/v1/completions", data="{not json",
                             headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= response.status_code < 500
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    ok = requests.post(f"{server.url}/v1/completions", json={
        "model": str(model_dir), "prompt": "hello", "max_tokens": 8}, timeout=120)
    assert ok.status_code == 200
