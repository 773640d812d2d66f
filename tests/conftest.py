"""Shared engines and prompts. Engines start once per module (tens of seconds)."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

from vllm_selfspec.assets import ROOT

MODEL_DIR = ROOT / "models" / "smollm2-135m"
sys.path.insert(0, str(ROOT / "scripts"))  # the serving helpers tests share with scripts
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# Test engines compute on every core this process may use (vLLM keeps one for
# the scheduler): the suite waits on them, and the parity it checks holds at
# any thread count. Tensor-parallel tests bind one core per rank themselves.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                      ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))))

# float32 and eager: exact parity holds there (docs/design.md); eager starts in
# 30-60 s instead of minutes of inductor compilation.
ENGINE_DEFAULTS = dict(
    model=str(MODEL_DIR),
    dtype="float32",
    max_model_len=1024,
    enforce_eager=True,
    seed=0,
    block_size=32,
    # Parity tests send 8 requests at a time (batch 8); the sampling tests'
    # hundreds of requests run 32 wide, in a quarter of the rounds.
    max_num_seqs=32,
    max_num_batched_tokens=256,  # long prompts prefill in chunks beside decodes
)


# Modules that start no engine: they run first, and a failure among them
# stops the session before any engine starts (minutes saved on a broken tree).
ENGINE_FREE_MODULES = ("test_config", "test_patches", "test_exit_stats",
                       "test_draft_weights", "test_safety", "test_round_policy",
                       "test_mechanism_gate", "test_benchmark", "test_skip_search")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in ENGINE_FREE_MODULES:
            item.add_marker(pytest.mark.engine_free)
    items.sort(key=lambda item: item.get_closest_marker("engine_free") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and item.get_closest_marker("engine_free") is not None:
        item.session.shouldstop = "an engine-free test failed; engine tests not started"


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, model_dir) -> Path:
    """A random 3-layer Llama with SmolLM2's tokenizer, for quick training runs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, path / name)
    return path


FIRST_LAYERS = 4


@pytest.fixture(scope="session")
def smollm2_first_layers_dir(tmp_path_factory, model_dir) -> Path:
    """SmolLM2 cut to its first FIRST_LAYERS layers (its own weights, so
    drafts still get accepted): a compiled engine of it starts in about a
    minute, not 5."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp(f"smollm2-{FIRST_LAYERS}-layers")
    for source in model_dir.iterdir():
        if source.suffix != ".safetensors":
            shutil.copy(source, path / source.name)
            continue
        kept = {name: tensor for name, tensor in load_file(source).items()
                if (match := re.search(r"layers\.(\d+)\.", name)) is None
                or int(match.group(1)) < FIRST_LAYERS}
        save_file(kept, path / source.name, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": FIRST_LAYERS}))
    return path


@pytest.fixture(scope="session")
def tiny_llama_outputs(tiny_llama_dir, test_prompts) -> list[str]:
    """Plain vLLM on the random 3-layer Llama: what tensor-parallel runs must give."""
    plain = start_engine(None, model=str(tiny_llama_dir))
    try:
        return greedy(plain, test_prompts[:8], 8)
    finally:
        stop_engine(plain)


@contextlib.contextmanager
def tensor_parallel_engine(spec: dict, model_dir: Path, monkeypatch):
    """A TP=2 engine of `spec` (mp backend, one core per rank) with the
    plugin's worker methods, stopped afterwards."""
    from vllm_selfspec.diagnostics import WORKER_EXTENSION

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = start_engine(spec, model=str(model_dir), tensor_parallel_size=2,
                       worker_extension_cls=WORKER_EXTENSION)
    try:
        yield llm
    finally:
        stop_engine(llm)


def run_tensor_parallel(spec: dict, model_dir: Path, prompts: list[str], monkeypatch,
                        report_rpc: str):
    """Greedy outputs of `spec` at TP=2, their acceptance, and every rank's
    answer to the worker method `report_rpc`."""
    with tensor_parallel_engine(spec, model_dir, monkeypatch) as llm:
        acceptance = Acceptance()
        outputs = greedy(llm, prompts, 8, acceptance=acceptance)
        reports = llm.collective_rpc(report_rpc)
    return outputs, acceptance, reports


def identity_heads(path: Path, model_dir: Path, exit_layers: list[int]) -> Path:
    """AdaDecode/DEL heads that are the model's own LM head (T = I) at these exits."""
    import torch
    from transformers import AutoConfig

    from vllm_selfspec.draft.heads import (
        local_final_norm,
        model_identity,
        save_heads,
    )

    hf_config = AutoConfig.from_pretrained(model_dir)
    identity = model_identity(hf_config, local_final_norm(str(model_dir)))
    eye = torch.eye(hf_config.hidden_size)
    save_heads(path, model_dir.name, identity, {e: eye for e in exit_layers})
    return path


@pytest.fixture(scope="session")
def test_prompts(model_dir) -> list[str]:
    """24 prompts, 25 to ~600 tokens: code, chat questions, and two long ones
    that exceed the 256-token budget (chunked prefill)."""
    from vllm_selfspec import prompts

    mixed = prompts.mixed(22)
    long_code = "\n".join(prompts.humaneval(12)[8:12])
    return [*mixed, long_code, long_code + "\n# And a test:\n"]


# Draft & Verify with a skip set that drafts badly (verification rejects and
# rolls back a lot) and lookup drafts on, which then stand out by their
# acceptance; requests without a match self-draft.
SKIP_SET_WITH_LOOKUP = {"method": "draft_verify", "num_speculative_tokens": 4,
                        "attn_skip": [5, 9, 13, 17, 21, 25], "mlp_skip": [8, 14, 20, 26],
                        "lookup": {"min_match": 3}}


@pytest.fixture(scope="session")
def skip_set_with_lookup():
    """One engine for test_draft_verify.py and test_lookup.py (an engine start
    saved); they run one after the other."""
    llm = start_engine(SKIP_SET_WITH_LOOKUP)
    yield llm
    stop_engine(llm)


@pytest.fixture(scope="session")
def plain():
    """Plain vLLM, the reference every method's outputs are compared with."""
    llm = start_engine(None)
    yield llm
    stop_engine(llm)


@pytest.fixture(scope="session")
def plain_outputs(plain, test_prompts) -> dict[int, list[str]]:
    return {size: greedy(plain, prompts_at(test_prompts, size), size) for size in (1, 8)}


# Tokens each parity request generates: with 32-token KV blocks every request
# crosses a block boundary.
PARITY_TOKENS = 32


def prompts_at(test_prompts: list[str], batch_size: int) -> list[str]:
    """The parity prompts at a batch size, the two chunked-prefill ones last:
    16 at batch 8 (two full batches, the first 8 shared with tests that take
    `test_prompts[:8]`), 6 at batch 1, where every token costs a whole step."""
    return [*test_prompts[:14 if batch_size > 1 else 4], *test_prompts[-2:]]


# The draft base every method's own tests pin: the target's own weights, its
# whole vocabulary, no lookups, so a test sees its mechanism alone. The
# defaults (an int8 copy, the shipped vocabulary, lookups) are tested in
# test_cheap_drafts.py and test_config.py.
EXACT_DRAFT = {"draft_precision": "target", "draft_vocab": "full", "lookup": False}


def forced(spec: dict, exact_draft: bool = True) -> dict:
    """`spec` drafting every round: test engines check drafting itself, which
    cost-aware budgets would often turn off on this CPU (a test that wants
    them says `cost_aware: True`); over EXACT_DRAFT unless `exact_draft` is
    False. Keys `spec` gives win."""
    from vllm_selfspec.config import METHOD_MODULES

    if spec.get("method") not in METHOD_MODULES:
        return spec
    return {"cost_aware": False, **(EXACT_DRAFT if exact_draft else {}), **spec}


# One-rank test engines run their engine core in this process (vLLM's own
# switch): no engine-core process to spawn and import vLLM and torch again,
# which took a large share of each of the suite's many engine starts.
# Tensor-parallel engines keep vLLM's worker processes. Subprocesses that start
# an engine of their own take the same environment.
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_live_in_process: dict[int, object] = {}  # id() of each running in-process engine: its config


@contextlib.contextmanager
def in_process():
    """Start an engine in this process: ONE_PROCESS set while it starts; what
    earlier engines left for the garbage collector is collected first (each
    engine core freezes the collector's objects at start-up)."""
    from vllm import envs

    try:
        with mock.patch.dict(os.environ, ONE_PROCESS):
            envs.disable_envs_cache()
            gc.unfreeze()
            gc.collect()
            yield
    finally:
        envs.disable_envs_cache()


def start_engine(speculative_config: dict | None = None, exact_draft: bool = True,
                 **overrides):
    from vllm import LLM

    if speculative_config is not None:
        speculative_config = forced(speculative_config, exact_draft)
        overrides.setdefault("per_request_spec_decode_metrics", "summary")
    args = {**ENGINE_DEFAULTS, **overrides}
    if args.get("tensor_parallel_size", 1) > 1:
        return LLM(**args, speculative_config=speculative_config)
    with in_process():
        llm = LLM(**args, speculative_config=speculative_config)
    _live_in_process[id(llm)] = llm.llm_engine.vllm_config
    return llm


def stop_engine(llm) -> None:
    """The benchmark's shutdown (imported here so the engine-free tier does
    not load vLLM). An in-process engine core's shutdown tears down the
    process's distributed groups, which every in-process engine shares: while
    others still run, one-rank groups are set up again for them."""
    from bench.runner import shutdown

    in_process_engine = _live_in_process.pop(id(llm), None) is not None
    shutdown(llm)
    if in_process_engine and _live_in_process:
        _restore_one_rank_groups(next(iter(_live_in_process.values())))


def _restore_one_rank_groups(vllm_config) -> None:
    """The groups a one-rank vLLM worker sets up (world, tensor, pipeline and
    the others vLLM keeps), over a fresh local gloo store, under a running
    engine's config (vLLM reads it while it builds them)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=get_distributed_init_method("127.0.0.1",
                                                                get_open_port()))
        ensure_model_parallel_initialized(1, 1)


@dataclass
class Acceptance:
    """Drafted and accepted tokens, summed over requests (vLLM's per-request
    speculative metrics, which stay right with several engines in a process)."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    sources: collections.Counter = field(default_factory=collections.Counter)  # our token_sources, summed
    # Rounds by their accepted drafts (vLLM's per-request histograms, summed).
    rounds_accepting: collections.Counter = field(default_factory=collections.Counter)

    def add(self, output) -> None:
        for completion in output.outputs:  # n > 1: each has its own metrics
            stats = completion.spec_decode_metrics
            if stats is not None:
                self.drafted += stats.num_draft_tokens
                self.accepted += sum(j * n for j, n in enumerate(stats.histogram))
                self.rounds += sum(stats.histogram)
                self.rounds_accepting.update(
                    {accepted: n for accepted, n in enumerate(stats.histogram) if n})
                self.sources.update(stats.token_sources)


def greedy(llm, prompts: list[str], batch_size: int, max_tokens: int = PARITY_TOKENS,
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


def assert_greedy_parity_with_rejections(llm, plain_outputs, test_prompts,
                                         batch_size: int) -> None:
    """Greedy outputs equal plain vLLM's, and the method really drafted and
    really had drafts rejected (so rollback was exercised)."""
    acceptance = Acceptance()
    prompts = prompts_at(test_prompts, batch_size)
    outputs = greedy(llm, prompts, batch_size, acceptance=acceptance)
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, plain_outputs[batch_size]))
                  if a != b]
    assert not mismatched, f"prompts {mismatched} differ from plain vLLM"
    # Drafts on at least a sixth of the tokens (DEL declines most rounds at
    # batch 1 with its statistics still young).
    assert acceptance.drafted >= len(prompts) * PARITY_TOKENS / 6, acceptance
    assert 0 < acceptance.accepted < acceptance.drafted


# Round costs in plain steps at which the int8 copy's full-depth draft pays
# well at batch 1 (a fast CPU's: a draft step and its verification a quarter
# of a plain step).
GATED_COSTS = {"per_draft": 0.25, "round_overhead": 0.1, "per_verified": 0.02}


def gated_run(spec: dict, test_prompts, passes: int = 3
              ) -> tuple[list[list[str]], int, int, dict | None]:
    """`spec` cost-aware over an int8 copy in its own engine, the batch-1 parity
    prompts greedy `passes` times (one pass drafts in a few dozen rounds, too
    few for the gate's trials): each pass's outputs, the self-drafts the
    full-depth base and the method's mechanism made, and the mechanism gate's
    report. The round costs are pinned (`GATED_COSTS`): whether an int8 draft
    pays at all at batch 1 depends on the CPU (on a slow AVX2 one in float32
    it does not, and the engine rightly drafts nothing), and the gate is
    what is tested."""
    from vllm_selfspec.diagnostics import WORKER_EXTENSION

    llm = start_engine({**spec, "cost_aware": True, "draft_precision": "int8"},
                       worker_extension_cls=WORKER_EXTENSION)
    try:
        llm.collective_rpc("selfspec_pin_costs", args=(GATED_COSTS,))
        acceptance = Acceptance()
        outputs = [greedy(llm, prompts_at(test_prompts, 1), 1, acceptance=acceptance)
                   for _ in range(passes)]
        (gate,) = llm.collective_rpc("selfspec_mechanism_gate")
    finally:
        stop_engine(llm)
    by_mechanism = acceptance.sources["mechanism_drafted"]
    return outputs, acceptance.sources["self_drafted"] - by_mechanism, by_mechanism, gate


def assert_every_draft_accepted(llm, plain_outputs, test_prompts) -> None:
    """Drafts that are the target's own tokens (full depth) must all be accepted,
    and the outputs equal plain vLLM's: any KV or metadata bug shows as a rejection."""
    acceptance = Acceptance()
    prompts = prompts_at(test_prompts, 8)
    outputs = greedy(llm, prompts, 8, acceptance=acceptance)
    assert outputs == plain_outputs[8]
    # Full-depth drafts are all kept, so most tokens come from drafts.
    assert acceptance.drafted >= 0.6 * len(prompts) * PARITY_TOKENS, acceptance
    assert acceptance.accepted == acceptance.drafted, acceptance


REPRODUCED = 32  # seeded samples drawn twice by the sampling test


def assert_same_sampling_distribution(llm, reference_llm, samples: int = 300,
                                      after_rejections: bool = False,
                                      reproducible: bool = True, **sampling
                                      ) -> Acceptance:
    """Chi-square test of the 2nd and 3rd tokens sampled at temperature 0.8,
    which speculation produces through draft verification (the 1st comes from
    the prefill), against an engine without speculation; seeded requests
    must reproduce. `after_rejections` also tests the 7th and 10th tokens: by
    then most requests have had drafts rejected and tokens resampled from the
    remainder (the test checks that rejections happened), so a wrong residual
    distribution or a rollback bug shows there even where the first tokens
    look right. `sampling`: more SamplingParams (top-k, penalties, n: then
    samples / n requests, each seeded apart from its siblings' seeds).
    `reproducible` False: drafts come from other requests' answers, so a
    seeded request re-drawn later may differ (not checked). Returns
    the drafts' acceptance over the samples."""
    prompt, max_tokens, positions = (("The weather today is", 10, (1, 2, 6, 9))
                                     if after_rejections
                                     else ("My favourite animal is the", 3, (1, 2)))
    extra = tuple(sorted(sampling.items()))
    n = sampling.get("n", 1)
    seeds = range(0, samples, n)
    ours, acceptance = _sampled_tokens(llm, prompt, seeds, max_tokens, positions, extra)
    if reproducible:  # re-drawn in other batches: a draft must not depend on its batch
        assert _sampled_tokens(llm, prompt, seeds[:REPRODUCED], max_tokens, positions,
                               extra)[0] == ours[:REPRODUCED * n], (
            "seeded requests did not reproduce")
    if after_rejections:
        assert acceptance.drafted > acceptance.accepted > 0, acceptance
    _assert_same_columns(ours, _reference_samples(reference_llm, prompt, seeds,
                                                  max_tokens, positions, extra))
    return acceptance


def _assert_same_columns(ours, reference) -> None:
    for position in range(len(ours[0])):
        table = _contingency([t[position] for t in ours],
                             [t[position] for t in reference])
        assert len(table[0]) >= 3, "prompt too peaked for a meaningful test"
        from scipy.stats import chi2_contingency

        p_value = chi2_contingency(table).pvalue
        assert p_value > 1e-3, f"sampled column {position} differs (p={p_value})"


@functools.cache
def _reference_samples(reference_llm, prompt: str, seeds: range, max_tokens: int,
                       positions: tuple[int, ...], extra: tuple) -> list[tuple[int, ...]]:
    """The reference engine's samples, drawn once per session (seeded, so
    every method's test compares against the same draw)."""
    return _sampled_tokens(reference_llm, prompt, seeds, max_tokens, positions, extra)[0]


def _sampled_tokens(llm, prompt: str, seeds: range, max_tokens: int,
                    positions: tuple[int, ...], extra: tuple = ()
                    ) -> tuple[list[tuple[int, ...]], Acceptance]:
    """Each seeded sample's tokens at `positions` (every completion of each
    request), and the drafts' acceptance."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=seed,
                             ignore_eos=True, **dict(extra)) for seed in seeds]
    outputs = llm.generate([prompt] * len(seeds), params, use_tqdm=False)
    acceptance = Acceptance()
    for output in outputs:
        acceptance.add(output)
    return [tuple(completion.token_ids[p] for p in positions)
            for o in outputs for completion in o.outputs], acceptance


def _contingency(first: list[int], second: list[int]) -> list[list[int]]:
    """Counts per token, tokens rarer than 10 in total merged into one column."""
    total = collections.Counter(first) + collections.Counter(second)
    common = [token for token, count in total.items() if count >= 10]
    rows = []
    for sample in (first, second):
        counts = collections.Counter(t if t in common else -1 for t in sample)
        rows.append([counts[token] for token in [*common, -1]])
    return rows
