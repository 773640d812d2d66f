"""`vllm serve` with each method on loopback: the documented command works,
answers OpenAI-compatible requests, counts our drafts on /metrics, and survives
bad requests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

SPECS = {
    "draft_verify": {"method": "draft_verify", "config_file": "smollm2-135m"},
    "adadecode": {"method": "adadecode", "heads": "smollm2-135m", "threshold": 0.5},
    "del": {"method": "del", "heads": "smollm2-135m"},
    "swift": {"method": "swift", "context_window": 8},
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=list(SPECS))
def server(request, model_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    vllm_cli = Path(sys.executable).with_name("vllm")
    command = [
        str(vllm_cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--block-size", "32", "--max-num-seqs", "8",
        "--speculative-config", json.dumps(SPECS[request.param]),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(2)
    else:
        process.kill()
        pytest.fail(f"vllm serve did not become healthy:\n{log.read_text()[-3000:]}")
    yield url
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def _spec_counter(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    values = re.findall(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$",
                        text, flags=re.M)
    return sum(float(v) for v in values)


def test_completion_and_chat(server, model_dir):
    completion = requests.post(f"{server}/v1/completions", json={
        "model": str(model_dir), "prompt": "def fibonacci(n):", "max_tokens": 32,
        "temperature": 0, "vllm_xargs": {"selfspec_task": "code"}}, timeout=120).json()
    assert len(completion["choices"][0]["text"]) > 10
    assert completion["usage"]["completion_tokens"] == 32
    chat = requests.post(f"{server}/v1/chat/completions", json={
        "model": str(model_dir), "max_tokens": 24, "temperature": 0.8, "seed": 3,
        "messages": [{"role": "user", "content": "Name three colours."}]},
        timeout=120).json()
    assert chat["choices"][0]["message"]["content"]


def test_streaming(server, model_dir):
    with requests.post(f"{server}/v1/completions", json={
            "model": str(model_dir), "prompt": "1, 2, 3,", "max_tokens": 24,
            "temperature": 0, "stream": True}, stream=True, timeout=120) as response:
        chunks = [line for line in response.iter_lines() if line.startswith(b"data: {")]
    assert len(chunks) >= 3  # several verification steps, several chunks


def test_metrics_count_our_drafts(server, model_dir):
    drafted = _spec_counter(server, "num_draft_tokens")
    accepted = _spec_counter(server, "num_accepted_tokens")
    requests.post(f"{server}/v1/completions", json={
        "model": str(model_dir), "prompt": "for i in range(10):", "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}, timeout=120).raise_for_status()
    assert _spec_counter(server, "num_draft_tokens") > drafted
    assert _spec_counter(server, "num_accepted_tokens") > accepted


def test_bad_requests_get_4xx_and_server_keeps_serving(server, model_dir):
    bad = [
        {"model": str(model_dir), "prompt": "hi", "temperature": -1},
        {"model": str(model_dir), "prompt": "hi", "max_tokens": 5000},
        {"model": str(model_dir), "prompt": "hi " * 2000, "max_tokens": 8},
    ]
    for body in bad:
        response = requests.post(f"{server}/v1/completions", json=body, timeout=120)
        assert 400 <= response.status_code < 500, (body, response.text[:300])
    response = requests.post(f"{server}/v1/completions", data="{not json",
                             headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= response.status_code < 500
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    ok = requests.post(f"{server}/v1/completions", json={
        "model": str(model_dir), "prompt": "hello", "max_tokens": 8}, timeout=120)
    assert ok.status_code == 200
