"""Shared engines and prompts. Engines start once per module (tens of seconds)."""

from __future__ import annotations

import gc
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_selfspec.assets import ROOT

MODEL_DIR = ROOT / "models" / "smollm2-135m"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

# float32 and eager: exact parity holds there (see README); eager starts in
# ~30 s instead of ~2 min of inductor compilation.
ENGINE_DEFAULTS = dict(
    model=str(MODEL_DIR),
    dtype="float32",
    max_model_len=1024,
    enforce_eager=True,
    seed=0,
    block_size=32,
    max_num_seqs=8,
    max_num_batched_tokens=128,  # long prompts prefill in chunks beside decodes
)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"{MODEL_DIR} is missing: run `bash scripts/setup.sh --no-run`")
    return MODEL_DIR


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, model_dir) -> Path:
    """A tiny random GPT-2: an architecture the draft engine does not support."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=49152)) \
        .save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)
    return path


def start_engine(speculative_config: dict | None = None, **overrides):
    from vllm import LLM

    if speculative_config is not None:
        overrides.setdefault("per_request_spec_decode_metrics", "summary")
    return LLM(**{**ENGINE_DEFAULTS, **overrides}, speculative_config=speculative_config)


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@dataclass
class Acceptance:
    """Drafted and accepted tokens, summed over requests (vLLM's per-request
    speculative metrics, which stay right with several engines in a process)."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    def add(self, output) -> None:
        stats = output.outputs[0].spec_decode_metrics
        if stats is not None:
            self.drafted += stats.num_draft_tokens
            self.accepted += sum(j * n for j, n in enumerate(stats.histogram))
            self.rounds += sum(stats.histogram)


def greedy(llm, prompts: list[str], batch_size: int, max_tokens: int = 48,
           acceptance: Acceptance | None = None) -> list[str]:
    """Generate greedily, `batch_size` requests in flight at a time."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        outputs = llm.generate(prompts[start : start + batch_size], params,
                               use_tqdm=False)
        for output in outputs:
            texts.append(output.outputs[0].text)
            if acceptance is not None:
                acceptance.add(output)
    return texts
