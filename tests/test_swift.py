"""SWIFT on the real engine: lossless while the skip set is searched and
switched mid-request, a learned set that matches the target better than the
uniform one on the same windows, per-task searches, the learned set exported
for draft_verify and compiled in a compiled engine, and bad configs refused
(its ranks' agreement is checked over Ray, in test_tensor_parallel.py)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import (
    Acceptance,
    assert_greedy_parity_with_rejections,
    gated_run,
    greedy,
    start_engine,
    stop_engine,
)
from tests.test_config import engine_config
from vllm_selfspec.diagnostics import WORKER_EXTENSION

# A short window and quick stop so the search runs, and switches the drafting
# set, inside the test requests.
SEARCHING = {"method": "swift", "context_window": 8, "bayes_interval": 5,
             "max_iterations": 400}


@pytest.fixture(scope="module")
def swift(tmp_path_factory):
    export_dir = tmp_path_factory.mktemp("swift-export")
    llm = start_engine({**SEARCHING, "export_dir": str(export_dir)},
                       worker_extension_cls=WORKER_EXTENSION)
    llm.export_dir = export_dir
    yield llm
    stop_engine(llm)


def search_report(llm) -> dict:
    (report,) = llm.collective_rpc("selfspec_search")
    return report


@pytest.mark.parametrize("batch_size", [8, 1])  # the search still runs in the second
def test_greedy_output_identical_to_plain_vllm(swift, plain_outputs, test_prompts,
                                               batch_size):
    before = search_report(swift)["tasks"].get("default", {}).get("iterations", 0)
    assert_greedy_parity_with_rejections(swift, plain_outputs, test_prompts, batch_size)
    report = search_report(swift)["tasks"]["default"]
    assert report["iterations"] > before, "the search did not run during the requests"


def test_search_learns_a_better_set_and_exports_it(swift, test_prompts, model_dir):
    """By the end of the search the incumbent predicts the target's next
    tokens better than the uniform set on the same windows, the engine drafts
    with it, and it is written as a draft_verify config."""
    for _ in range(40):  # ~400 candidates at W = 8 end the search well before this
        if search_report(swift)["tasks"]["default"]["done"]:
            break
        greedy(swift, test_prompts[:8], 8)
    report = search_report(swift)
    assert report["tasks"]["default"]["done"], "the search did not end"
    search = report["tasks"]["default"]
    assert search["iterations"] <= SEARCHING["max_iterations"]
    late = search["windows"][-3:]
    assert sum(w["incumbent"] for w in late) > sum(w["uniform"] for w in late), late
    assert report["drafting"] == {"attn_skip": search["attn_skip"],
                                  "mlp_skip": search["mlp_skip"], "compiled": False}
    exported = swift.export_dir / "default.json"
    assert json.loads(exported.read_text())["how_made"].startswith("SWIFT")
    spec = engine_config(model_dir, {"method": "draft_verify",
                                     "config_file": str(exported)}).speculative_config
    assert (spec.attn_skip, spec.mlp_skip) == (search["attn_skip"], search["mlp_skip"])


def test_tasks_search_separately(swift, test_prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                            extra_args={"selfspec_task": "prose"})
    swift.generate(test_prompts[:2], params, use_tqdm=False)
    tasks = search_report(swift)["tasks"]
    assert tasks["prose"]["iterations"] > 0
    assert not tasks["prose"]["done"]


def test_cost_aware_search_waits_where_no_set_could_pay(swift, test_prompts):
    """Cost-aware, with a goal no set can pay at (matchness 0: drafts that are
    all rejected), the rounds that draft (probes here) score no candidate.
    Probes are spaced by the measured draft cost, so requests run (batch 1)
    until one probe has found a full window, up to a bound."""
    from vllm import SamplingParams

    options = {"cost_aware": (True, False), "stop_matchness": (0.0, 0.95)}
    for name, (value, _) in options.items():
        swift.collective_rpc("selfspec_set_option", args=(name, value))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True,
                                extra_args={"selfspec_task": "futile"})
        for prompt in test_prompts[:16]:
            swift.generate([prompt], params, use_tqdm=False)
            if search_report(swift)["futile_rounds"] > 0:
                break
    finally:
        for name, (_, value) in options.items():
            swift.collective_rpc("selfspec_set_option", args=(name, value))
    report = search_report(swift)
    assert report["futile_rounds"] > 0, "no probe found a full window, so nothing was checked"
    assert report["tasks"]["futile"]["iterations"] == 0


def test_task_keys_cannot_write_outside_export_dir_or_grow_state(swift, test_prompts,
                                                                 tmp_path):
    """Traversal and absolute-path keys, odd types and more new keys in one
    batch than max_tasks all end in "default": no file appears outside
    export_dir, and the searches held stay within max_tasks."""
    from vllm import SamplingParams

    outside = tmp_path / "escaped"
    keys = ["../../escaped", str(outside), "a/b", "", "x" * 65, 7,
            *[f"client{i}" for i in range(12)]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             extra_args={"selfspec_task": key}) for key in keys]
    swift.generate([test_prompts[0]] * len(keys), params, use_tqdm=False)
    report = search_report(swift)
    assert not list(tmp_path.rglob("*.json")) and not outside.exists()
    assert not list(swift.export_dir.parent.glob("*.json"))
    assert set(report["refused_task_keys"]) == {"invalid", "over_max_tasks"}
    assert report["refused_task_keys"]["invalid"] >= 6
    (state,) = swift.collective_rpc("selfspec_state")
    assert state["requests_with_state"]["tasks"] == len(report["tasks"]) <= 8


def test_the_full_depth_base_drafts_where_the_skip_set_loses(plain_outputs, test_prompts):
    """Cost-aware over an int8 copy (`full_depth`, the default): the uniform
    skip set drafts only in the gate's trials, the copy's full-depth draft
    (far better accepted) the rest, losslessly; full_depth false: every
    self-draft is the skip set's."""
    for full_depth in (True, False):
        # Without the base one pass shows every draft is the skip set's.
        outputs, by_base, by_mechanism, gate = gated_run(
            {"method": "swift", "full_depth": full_depth}, test_prompts,
            passes=3 if full_depth else 1)
        assert all(texts == plain_outputs[1] for texts in outputs)
        if full_depth:
            assert by_base > 4 * by_mechanism > 0, (by_base, by_mechanism, gate)
            # Timed (the skip set's float layers against the copy's int8
            # ones): which is cheaper depends on the CPU.
            assert 0 < gate["step_cost_share"] < math.inf, gate
        else:
            assert gate is None and by_base == 0 < by_mechanism, (by_base, by_mechanism)


def test_compiled_engine_compiles_the_learned_set(smollm2_first_layers_dir, test_prompts,
                                                 tmp_path, monkeypatch):
    """A compiled engine drafts with the uniform set's start-up graph while
    the search runs and, once it ends, with the learned set compiled; the
    outputs stay the target's, scoring candidates compiles nothing (start-up
    warmed the uncompiled draft), and no graph of the learned set is saved."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    spec = {"method": "swift", "context_window": 16, "max_iterations": 20}
    llm = start_engine(spec, model=str(smollm2_first_layers_dir), enforce_eager=False,
                       worker_extension_cls=WORKER_EXTENSION)
    try:
        prompts = test_prompts[:4]
        searching = greedy(llm, prompts, 4, max_tokens=48)
        for _ in range(5):  # 20 candidates, one a round, end within a few passes
            if search_report(llm)["tasks"]["default"]["done"]:
                break
            assert greedy(llm, prompts, 4, max_tokens=48) == searching
        report = search_report(llm)
        assert report["tasks"]["default"]["done"], "the search did not end"
        search = report["tasks"]["default"]
        assert (search["attn_skip"], search["mlp_skip"]) == (
            report["drafting"]["attn_skip"], report["drafting"]["mlp_skip"])
        assert report["drafting"]["compiled"]
        assert report["scoring_compiles"] == 0, "a request waited for a compile while scoring"
        assert set(report["compile_seconds"]) == {"default"}, \
            "the search kept the uniform set: nothing to compile"
        acceptance = Acceptance()
        assert greedy(llm, prompts, 4, max_tokens=48, acceptance=acceptance) == searching
        assert 0 < acceptance.accepted < acceptance.drafted
    finally:
        stop_engine(llm)
    saved = list((tmp_path / "torch_compile_cache").rglob("rank_0_0/model"))
    # From start-up: the target, the uniform set's draft and the full-depth base.
    assert len(saved) == 3, saved


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"skip_ratio": 1.5}, r"skip_ratio: 1\.5 is outside \[0, 1\]"),
        ({"skip_ratio": 0.01}, r"skip_ratio: 0\.01 of the 56 skippable sub-blocks"),
        ({"context_window": 0}, r"context_window: 0 must be >= 1"),
        ({"confidence": 2}, r"confidence: 2\.0 is outside \[0, 1\]"),
        ({"bayes_interval": -1}, r"bayes_interval: -1 must be >= 0"),
        ({"skip_set": [1]}, r"unknown key\(s\) \['skip_set'\]"),
        ({"max_tasks": 0}, r"max_tasks: 0 must be >= 1"),
        ({"search_share": 0}, r"search_share: 0\.0 is outside \(0, 1\]"),
    ],
)
def test_bad_configs_fail_at_start_up(model_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        engine_config(model_dir, {"method": "swift", **spec})
