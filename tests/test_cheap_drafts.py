"""Every method at its defaults, on the real engine: given nothing but its
name, each drafts through an int8 copy of the target's weights, the
vocabulary and heads shipped for the model, and lookups first, and stays
lossless (greedy at batch 1 and 8, and sampling for the recommended setting);
the copy is really there. Drafting is forced (`cost_aware: false`) so that
every round drafts."""

from __future__ import annotations

import pytest

from tests.conftest import (
    assert_greedy_parity_with_rejections,
    assert_same_sampling_distribution,
    start_engine,
    stop_engine,
)
from vllm_selfspec.assets import CONFIGS_DIR
from vllm_selfspec.config import METHOD_MODULES
from vllm_selfspec.diagnostics import WORKER_EXTENSION


@pytest.fixture(scope="module", params=list(METHOD_MODULES))
def cheap(request):
    llm = start_engine({"method": request.param}, exact_draft=False,
                       worker_extension_cls=WORKER_EXTENSION)
    llm.method = request.param
    yield llm
    stop_engine(llm)


def test_the_draft_reads_an_int8_copy_and_a_reduced_head(cheap, model_dir):
    """...and, on the CPU, every layer it drafts through attends through one
    op (`draft/attention.py`); the greedy tests below show it attends right."""
    import json

    (report,) = cheap.collective_rpc("selfspec_draft_weights")
    vocab = json.loads((CONFIGS_DIR / "vocab" / "smollm2-135m.json").read_text())
    assert report["precision"] == "int8"
    assert report["vocab_tokens"] == vocab["size"] < 49152
    # float32 model: int8 linears are a quarter of their bytes, the head a subset.
    assert 0.05 * report["model_bytes"] < report["extra_bytes"] < 0.3 * report["model_bytes"]
    assert report["one_op_attention_layers"] == report["draft_depth"] >= 22


def test_the_draft_forward_multiplies_in_int8(cheap):
    """The operators a draft forward spends its time in: this CPU's int8
    kernel runs there, never in a plain one (vLLM's: oneDNN's int8 activation
    quantisation, or on AMX the sgl kernel that quantises inside; on an x86
    CPU without VNNI or AMX fbgemm's dynamic int8 linear)."""
    from vllm_selfspec.draft.kernels import int8_runs_fbgemm

    (profile,) = cheap.collective_rpc("selfspec_profile_forwards")
    int8_ops = ("linear_dynamic",) if int8_runs_fbgemm() else (
        "int8_quant", "int8_scaled_mm_with_quant")

    def int8_calls(forward: str) -> float:
        return sum(op["calls_per_step"] for op in profile[forward]["operators"]
                   if any(name in op["name"] for name in int8_ops))

    assert int8_calls("plain") == 0
    assert int8_calls("draft") >= 1


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_output_identical_to_plain_vllm(cheap, plain_outputs, test_prompts,
                                               batch_size):
    assert_greedy_parity_with_rejections(cheap, plain_outputs, test_prompts, batch_size)


@pytest.mark.parametrize("cheap", ["draft_verify"], indirect=True)
def test_sampling_keeps_the_target_distribution(cheap, plain):
    """Draft & Verify at its defaults is the recommended setting."""
    assert_same_sampling_distribution(cheap, plain)
