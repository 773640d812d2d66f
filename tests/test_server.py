"""`vllm serve` with each method on loopback: the documented command works,
answers OpenAI-compatible requests, counts our drafts on /metrics, and survives
bad requests."""

from __future__ import annotations

import pytest
import requests

SPECS = {
    "draft_verify": {"method": "draft_verify", "config_file": "smollm2-135m"},
    "adadecode": {"method": "adadecode", "heads": "smollm2-135m", "threshold": 0.5},
    "del": {"method": "del", "heads": "smollm2-135m-del"},
    "swift": {"method": "swift", "context_window": 8},
}


@pytest.fixture(scope="module", params=list(SPECS))
def server(request, model_dir, tmp_path_factory):
    from serving import vllm_serve

    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--block-size", "32", "--max-num-seqs", "8"]
    log = tmp_path_factory.mktemp("server") / "serve.log"
    try:
        with vllm_serve(model_dir, SPECS[request.param], log, args,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, start_timeout=300) as running:
            yield running
    except RuntimeError as error:
        pytest.fail(str(error))


def test_completion_and_chat(server, model_dir):
    completion = requests.post(f"{server.url}/v1/completions", json={
        "model": str(model_dir), "prompt": "def fibonacci(n):", "max_tokens": 32,
        "temperature": 0, "vllm_xargs": {"selfspec_task": "code"}}, timeout=120).json()
    assert len(completion["choices"][0]["text"]) > 10
    assert completion["usage"]["completion_tokens"] == 32
    chat = requests.post(f"{server.url}/v1/chat/completions", json={
        "model": str(model_dir), "max_tokens": 24, "temperature": 0.8, "seed": 3,
        "messages": [{"role": "user", "content": "Name three colours."}]},
        timeout=120).json()
    assert chat["choices"][0]["message"]["content"]


def test_streaming(server, model_dir):
    with requests.post(f"{server.url}/v1/completions", json={
            "model": str(model_dir), "prompt": "1, 2, 3,", "max_tokens": 24,
            "temperature": 0, "stream": True}, stream=True, timeout=120) as response:
        chunks = [line for line in response.iter_lines() if line.startswith(b"data: {")]
    assert len(chunks) >= 3  # several verification steps, several chunks


def test_metrics_count_our_drafts(server, model_dir):
    drafted, accepted, _ = server.spec_counters()
    requests.post(f"{server.url}/v1/completions", json={
        "model": str(model_dir), "prompt": "for i in range(10):", "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}, timeout=120).raise_for_status()
    drafted_after, accepted_after, _ = server.spec_counters()
    assert drafted_after > drafted
    assert accepted_after > accepted


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
