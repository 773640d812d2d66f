"""Every method at tensor parallel 2 on the CPU, on a random 3-layer Llama
(SmolLM2's 9 heads do not split in two): the mp backend offline (DEL's is in
its own module, with its statistics compared rank by rank), and
`vllm serve --distributed-executor-backend ray` (SWIFT, its search compared
rank by rank) on a local Ray instance on loopback (vLLM's RayExecutorV2,
`SELFSPEC_RAY_CPU=1`). Outputs equal plain vLLM's; both ranks drafted the same
tokens the same way."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import (
    PARITY_TOKENS,
    Acceptance,
    forced,
    greedy,
    identity_heads,
    run_tensor_parallel,
    tensor_parallel_engine,
)

SKIP_ONE = {"method": "draft_verify", "attn_skip": [1], "num_speculative_tokens": 3}
ADADECODE = {"method": "adadecode", "threshold": 0.0}  # + identity heads at layer 1
SWIFT = {"method": "swift", "context_window": 8, "skip_ratio": 0.5, "confidence": 0.0,
         "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_heads(tiny_llama_dir, tmp_path_factory) -> str:
    return str(identity_heads(tmp_path_factory.mktemp("heads"), tiny_llama_dir, [1]))


def test_mp_backend_adadecode(tiny_llama_dir, tiny_heads, tiny_llama_outputs, test_prompts,
                              monkeypatch):
    outputs, acceptance, (first, second) = run_tensor_parallel(
        {**ADADECODE, "heads": tiny_heads}, tiny_llama_dir, test_prompts[:8], monkeypatch,
        "selfspec_counters")
    assert outputs == tiny_llama_outputs
    assert acceptance.drafted > 50
    assert first == second and first["rounds"] > 8


def test_mp_backend_draft_verify_then_cost_aware(tiny_llama_dir, tiny_llama_outputs,
                                                 test_prompts, monkeypatch):
    """Drafting every round, then with cost_aware on in the same engine: each
    rank times the draft (the forwards hold collectives, so all must run them)
    and takes rank 0's costs, so both ranks budget, draft and count alike; the
    outputs are plain vLLM's both times."""
    with tensor_parallel_engine(SKIP_ONE, tiny_llama_dir, monkeypatch) as llm:
        acceptance = Acceptance()
        forced_outputs = greedy(llm, test_prompts[:8], 8, acceptance=acceptance)
        forced_counters = llm.collective_rpc("selfspec_counters")
        for name, value in (("cost_aware", True), ("probe_every", 4)):
            llm.collective_rpc("selfspec_set_option", args=(name, value))
        cost_aware_outputs = greedy(llm, test_prompts[:8], 8)
        first, second = llm.collective_rpc("selfspec_counters")
    assert forced_outputs == cost_aware_outputs == tiny_llama_outputs
    assert acceptance.drafted > 50
    assert forced_counters[0] == forced_counters[1] and forced_counters[0]["rounds"] > 8
    assert first == second and first["rounds"] > forced_counters[0]["rounds"] + 8


@pytest.fixture(scope="module")
def local_ray():
    """A Ray head on 127.0.0.1 with one CPU per rank, stopped afterwards."""
    from serving import free_port

    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    subprocess.run([ray_cli, "start", "--head", "--node-ip-address=127.0.0.1",
                    f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)


def test_ray_executor_serves_swift(local_ray, tiny_llama_dir, tiny_llama_outputs,
                                   test_prompts, tmp_path):
    """SWIFT over Ray: its search state must agree across actors through a
    broadcast every search step, the hardest of the methods' per-rank state
    (DEL's statistics agree rank by rank with the mp backend in test_del.py).
    Both actors hold the same search and draft with the same set."""
    from serving import vllm_serve

    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--block-size", "32", "--max-num-seqs", "8", "--seed", "0",
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    env = {"RAY_ADDRESS": local_ray, "SELFSPEC_RAY_CPU": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    with vllm_serve(tiny_llama_dir, forced(SWIFT), tmp_path / "serve.log", args, env=env,
                    dev_mode=True) as server:
        def complete(prompt: str) -> str:
            return requests.post(f"{server.url}/v1/completions", json={
                "model": str(tiny_llama_dir), "prompt": prompt, "max_tokens": PARITY_TOKENS,
                "temperature": 0, "ignore_eos": True}, timeout=300).json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as clients:  # batched, as the mp tests' requests
            outputs = list(clients.map(complete, test_prompts[:8]))
        counters = server.collective_rpc("selfspec_counters")
        states = server.collective_rpc("selfspec_state")
        searches = server.collective_rpc("selfspec_search")
        drafted, _, _ = server.spec_counters()
    assert outputs == tiny_llama_outputs
    assert drafted > 20
    assert len(counters) == 2 and counters[0] == counters[1] and counters[0]["rounds"] > 8
    for search in searches:
        search.pop("optimise_seconds")
    assert searches[0] == searches[1]
    assert searches[0]["tasks"]["default"]["iterations"] >= 5
    # Each rank ran in its own Ray actor, with our drafter in it.
    actors = {state["ray_actor"] for state in states}
    assert len(actors) == 2 and None not in actors, states


@pytest.mark.parametrize("spec", [
    {"method": "draft_verify", "config_file": "smollm2-135m"},
    {"method": "adadecode"},
    {"method": "del"},
    {"method": "swift", "context_window": 8},
], ids=lambda spec: spec["method"])
def test_engine_configs_pickle(model_dir, spec):
    """Ray actors and mp workers get the config pickled: ours must survive it
    whole (the method's own fields and the defaults chosen for the model
    included)."""
    import pickle

    from tests.test_config import engine_config
    from vllm_selfspec.config import COMMON_FIELDS

    config = engine_config(model_dir, spec).speculative_config
    copy = pickle.loads(pickle.dumps(config))
    assert type(copy) is type(config)
    for name in ("method", *config.own_fields(), *COMMON_FIELDS):
        assert getattr(copy, name) == getattr(config, name), name


def test_mp_backend_int8_draft_over_a_vocabulary_subset(tiny_llama_dir, tiny_llama_outputs,
                                                       test_prompts, monkeypatch, tmp_path):
    """Each rank quantises its own shard of the layers and of the subset head's
    rows; the shards' logits are all-gathered and scattered into the whole
    vocabulary, so both ranks draft alike, and the outputs are plain vLLM's."""
    from transformers import AutoConfig, AutoTokenizer

    from vllm_selfspec.draft.heads import local_final_norm, model_identity
    from vllm_selfspec.draft.vocab import save_vocab

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    seen = sorted({t for text in tiny_llama_outputs for t in tokenizer.encode(text)})
    identity = model_identity(AutoConfig.from_pretrained(tiny_llama_dir),
                              local_final_norm(str(tiny_llama_dir)))
    vocab = tmp_path / "tiny-vocab.json"
    save_vocab(vocab, "tiny-llama", identity, seen, len(seen))
    spec = {"method": "draft_verify", "num_speculative_tokens": 3,
            "draft_precision": "int8", "draft_vocab": str(vocab)}
    with tensor_parallel_engine(spec, tiny_llama_dir, monkeypatch) as llm:
        acceptance = Acceptance()
        outputs = greedy(llm, test_prompts[:8], 8, acceptance=acceptance)
        first, second = llm.collective_rpc("selfspec_counters")
    assert outputs == tiny_llama_outputs
    assert acceptance.drafted > 20
    assert first == second
