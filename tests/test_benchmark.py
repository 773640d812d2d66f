"""The benchmark's arithmetic, without an engine: speed-ups and their spread
over repeats of one engine start and over several starts, and by prompt set."""

from __future__ import annotations

import io
from collections import Counter
from types import SimpleNamespace

import pytest
from bench import machine
from bench.machine import (
    drifted_starts,
    engine_order,
    machine_speed,
    turns,
    typical_machine_speed,
    unbalanced_first_start,
)
from bench.presets import method_configs
from bench.report import machine_warnings, print_table, serving_ratios, summarize
from bench.runner import CONSOLE, Run, keep_nearer
from bench.workload import benchmark_requests, prompt_set_names
from serve_sweep import plan_runs
from vllm.engine.arg_utils import EngineArgs


def run_with(name: str, starts: list[list[float]]) -> Run:
    """A run whose engine starts decoded at these tokens/s, one per repeat."""
    run = Run(name, None if name == "plain" else {"method": "ngram"})
    for repeats in starts:
        run.tokens_per_s.extend(repeats)
        run.start_tokens_per_s.append(sum(repeats) / len(repeats))
    run.decode_tokens = run.generated = 10  # one token per target forward
    return run


def test_engine_starts_take_every_place_in_turn():
    """Each start runs every engine once, in the rows of a balanced Latin square."""
    runs = [Run(name, None) for name in ("plain", "a", "b")]
    order = [run.name for start in engine_order(runs, engine_starts=4) for run in start]
    assert order == ["plain", "a", "b", "a", "b", "plain", "b", "plain", "a",
                     "b", "a", "plain"]


@pytest.mark.parametrize("num_engines", [1, 2, 3, 4, 5, 6])
def test_interleaved_engines_follow_each_other_equally_often(num_engines):
    """Over a cycle of batches each engine decodes in every place equally often
    and right after each other engine equally often (the previous engine's
    worker still polls while the next decodes)."""
    cycle = num_engines if num_engines % 2 == 0 else 2 * num_engines
    orders = [turns(num_engines, index) for index in range(cycle)]
    assert all(sorted(order) == list(range(num_engines)) for order in orders)
    assert orders == [turns(num_engines, index) for index in range(cycle, 2 * cycle)]
    places = Counter((engine, order.index(engine)) for order in orders for engine in order)
    assert len(set(places.values())) == 1 and len(places) == num_engines ** 2
    follows = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(set(follows.values())) <= 1
    assert len(follows) == num_engines * (num_engines - 1)


@pytest.mark.parametrize("num_engines", [2, 3, 4, 5, 6])
def test_first_start_warning_exactly_when_some_engine_never_starts_first(num_engines):
    """The warning names the imbalance whenever some engine misses the first
    place more often than another, and is silent once starts balance it."""
    for starts in range(1, 2 * num_engines + 1):
        firsts = Counter(turns(num_engines, index)[0] for index in range(starts))
        balanced = len(firsts) == num_engines and len(set(firsts.values())) == 1
        warning = unbalanced_first_start(num_engines, starts)
        assert (warning is None) == balanced
        if warning:
            assert f"--engine-starts {num_engines}" in warning
    assert unbalanced_first_start(1, 1) is None


def test_one_start_spreads_over_its_repeats():
    plain, ours = run_with("plain", [[100, 100]]), run_with("ngram", [[90, 110]])
    _, row = summarize([plain, ours], num_layers=30, batch_size=1)
    assert row["speedup"] == 1.0
    assert row["speedup_spread"] == [0.9, 1.1]


def test_several_starts_compare_each_with_plains_same_start():
    """A slow spell that hits plain and the method in one round of starts
    moves neither ratio: the spread is per start, against plain's start."""
    plain = run_with("plain", [[100, 100], [80, 80]])
    ours = run_with("ngram", [[90, 90], [80, 80]])
    plain_row, row = summarize([plain, ours], num_layers=30, batch_size=1)
    assert row["speedup"] == pytest.approx(85 / 90, abs=1e-3)
    assert row["speedup_spread"] == [0.9, 1.0]
    assert row["tokens_per_s_starts"] == [90, 80]
    assert plain_row["speedup_spread"] == [round(80 / 90, 3), round(100 / 90, 3)]


def test_a_start_on_a_slower_machine_than_plains_is_flagged():
    """Each start's machine speed is compared with plain's same start; a start
    at 0.8x is flagged, one within 5 % of plain's machine is not."""
    plain = run_with("plain", [[100], [100]])
    ours = run_with("ngram", [[80], [102]])
    plain.start_machine_speed, ours.start_machine_speed = [10.0, 10.0], [8.0, 9.8]
    plain_row, row = summarize([plain, ours], num_layers=30, batch_size=1)
    assert row["machine_vs_plain_starts"] == [0.8, 0.98]
    assert row["machine_GBps_starts"] == [8.0, 9.8]
    assert "machine_vs_plain_starts" not in plain_row
    [warning] = machine_warnings([plain_row, row])
    assert "0.80x" in warning and "start 1" in warning and "ngram" in warning


def test_starts_off_the_runs_typical_machine_are_retaken_by_the_probe_alone():
    """A start whose probe strayed more than 5 % from the run's median (plain's
    included) is retaken; the retake replaces it only when the probe read it
    nearer the median, whatever its speed, and its requests' times go with it."""
    plain = run_with("plain", [[100], [100]])
    ours = run_with("del", [[90], [100]])
    plain.start_machine_speed, ours.start_machine_speed = [10.0, 10.2], [7.0, 10.1]
    ours.request_decode = [(10, 1.0), (10, 1.0), (10, 0.5), (10, 0.5)]  # 2 prompts x 2 starts
    typical = typical_machine_speed([plain, ours])
    assert typical == pytest.approx(10.05)
    assert drifted_starts([plain, ours], typical) == [(ours, 0)]

    def retake(tokens_per_s: float, machine: float, seconds: float) -> Run:
        """An engine started again: the earlier starts copied in, one new start."""
        return Run("del", ours.speculative_config, tokens_per_s=[tokens_per_s],
                   start_tokens_per_s=[*ours.start_tokens_per_s, tokens_per_s],
                   start_machine_speed=[machine], request_decode=[(10, seconds)] * 2)

    farther = retake(120, 6.0, 0.1)
    assert keep_nearer(ours, 0, farther, typical)["kept"] == "first"
    assert ours.start_tokens_per_s == [90, 100] and ours.start_machine_speed == [7.0, 10.1]

    nearer = retake(80, 9.9, 2.0)  # slower, yet the machine was typical
    record = keep_nearer(ours, 0, nearer, typical)
    assert record == {"start": 1, "machine_GBps": [7.0, 9.9], "tokens_per_s": [90, 80],
                      "kept": "retake"}
    assert ours.start_tokens_per_s == [80, 100] and ours.tokens_per_s == [80, 100]
    assert ours.start_machine_speed == [9.9, 10.1]
    assert ours.request_decode == [(10, 2.0), (10, 2.0), (10, 0.5), (10, 0.5)]
    assert drifted_starts([plain, ours], typical) == []
    _, row = summarize([plain, ours], num_layers=30, batch_size=1)
    assert row["speedup_spread"] == [0.8, 1.0] and len(row["retakes"]) == 2


def test_machine_speed_is_a_bandwidth_in_gb_per_s(monkeypatch):
    """The probe reports GB/s: four passes over PROBE_BYTES in the 2 s its
    clock says they took are 2 * PROBE_BYTES / 1e9; it leaves the caller's
    thread count as it found it."""
    import torch

    threads = torch.get_num_threads()
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock, 12.0))
    assert machine_speed() == pytest.approx(2 * machine.PROBE_BYTES / 1e9)
    assert torch.get_num_threads() == threads


def costs_of_engine_that_never_drafted(**measured) -> dict:
    """`selfspec_step_costs` of an engine with no drafted round timed."""
    return {"rounds": {"drafted": {}, "shared": {}}, "draft_copy_bytes": 0,
            "model_bytes": 1, **measured}


def test_a_setting_that_never_drafted_has_no_ideal_speedup():
    """A method that declined every round (step costs measured, no round
    drafted) is summarised with its speed and without S*, not a crash."""
    plain, ours = run_with("plain", [[100, 100]]), run_with("del", [[95, 97]])
    ours.speculative_config = {"method": "del"}
    ours.step_costs = costs_of_engine_that_never_drafted(cost_ratio=0.5,
                                                         fraction_of_sublayers_run=0.4)
    _, row = summarize([plain, ours], num_layers=30, batch_size=1)
    assert row["speedup"] == 0.96
    assert row["forward_cost_ratio"] == 0.5 and row["mean_accepted_length"] is None
    assert "ideal_speedup_forwards" not in row and "ideal_speedup_S*" not in row


def test_search_share_is_over_the_start_it_was_timed_in():
    """SWIFT's search time comes from one engine (the first start's), so its
    share is of that start's decoding: over all four starts it read 1 % where
    the engine spent 4 % of its decoding searching."""
    plain, ours = run_with("plain", [[100]] * 4), run_with("swift", [[95]] * 4)
    ours.speculative_config = {"method": "swift"}
    ours.first_start_decode_seconds = 33.0
    ours.step_costs = costs_of_engine_that_never_drafted(
        cost_ratio=0.6, fraction_of_sublayers_run=0.6,
        search={"optimise_seconds": 1.32, "futile_rounds": 0,
                "tasks": {"default": {"iterations": 1}}})
    _, row = summarize([plain, ours], num_layers=30, batch_size=1)
    assert row["optimise_share_of_decode"] == 0.04
    assert row["search_candidates"] == 1


def test_step_pieces_count_decode_steps_only():
    """profile_step.py's timer: a step that schedules a new prompt is left
    out of every piece, so the pieces span what decode timestamps span."""
    from types import SimpleNamespace

    from vllm_selfspec.diagnostics import RUNNER_PIECES, time_step_pieces

    runner = SimpleNamespace(**{name: lambda *args: None for name in RUNNER_PIECES},
                             drafter=SimpleNamespace(propose=lambda: None))
    time_step_pieces(runner, start=True)
    for new_prompts in ([], ["r1"], []):
        runner.execute_model(SimpleNamespace(scheduled_new_reqs=new_prompts))
        runner.sample_tokens(None)
        runner.drafter.propose()
    pieces = time_step_pieces(runner, start=False)
    assert set(pieces) == {"execute_model", "sample_tokens", "drafter.propose"}
    assert all(calls == 2 for calls, _ in pieces.values())
    time_step_pieces(runner, start=True)  # clears; the timers stay installed once
    runner.sample_tokens(None)
    assert time_step_pieces(runner, start=False) == {"sample_tokens": [1, pytest.approx(0, abs=0.1)]}


def test_step_profile_counts_the_operators_run_between_start_and_stop():
    """profile_step.py's `--operators`: the operators the engine's steps ran
    after `start`, none before it or after the read, by self time."""
    from types import SimpleNamespace

    import torch

    from vllm_selfspec.diagnostics import profile_decode_steps

    runner, x = SimpleNamespace(), torch.ones(64, 64)
    torch.mm(x, x)  # before the start: not counted
    assert profile_decode_steps(runner, start=True) is None
    for _ in range(3):
        torch.mm(x, x)
    torch.tanh(x)
    report = profile_decode_steps(runner, start=False)
    torch.mm(x, x)  # after the read: not counted
    calls = {op["name"]: op["calls"] for op in report["operators"]}
    assert calls["aten::mm"] == 3 and calls["aten::tanh"] == 1
    assert report["self_ms"] >= sum(op["self_ms"] for op in report["operators"]) > 0
    with pytest.raises(RuntimeError, match="start it first"):
        profile_decode_steps(runner, start=False)


def test_every_prompt_set_takes_turns_request_by_request():
    """`--prompt-set every`: the issue's four kinds, as many of each, in turn."""
    requests = benchmark_requests(2, prompt_set_names("every"))
    assert [name for name, _ in requests] == ["humaneval", "mtbench", "gsm", "copy"] * 2
    assert len({question for _, question in requests}) == 8
    assert [name for name, _ in benchmark_requests(4, ["mixed"])] == ["mixed"] * 4
    with pytest.raises(Exception, match="unknown prompt set math"):
        prompt_set_names("gsm,math")


@pytest.mark.parametrize("workload", ["mixed", "multiturn", "edit"])
def test_no_serving_run_asks_what_an_earlier_run_on_its_server_asked(workload):
    """A cache of past answers (suffix decoding's) drafts a request asked
    before exactly: each run of a server gets its own items, the mixed
    workload's warm-ups are none of them, and the follow-ups of the
    multi-turn and edit workloads differ from what they follow."""
    args = SimpleNamespace(temperatures=[0.0, 0.8], concurrency=[1, 4], min_prompts=8,
                           prompts_per_client=4, workload=workload, warmup_waves=1)
    runs, shared = plan_runs(args)
    assert not shared
    assert [len(run.items) for run in runs] == [8, 16, 8, 16]
    items = [repr(item) for run in runs for item in run.items]
    assert len(set(items)) == len(items)
    if workload == "mixed":
        assert [len(run.warmups) for run in runs] == [1, 4, 1, 4]
        assert not set(w for run in runs for w in run.warmups) & set(items)
    else:
        assert all(not run.warmups and all(first != second for first, second in run.items)
                   for run in runs)
    args.concurrency = [1, 2, 4, 8, 16, 32]  # 512 requests: more than the sets hold
    assert plan_runs(args)[1]
    args.concurrency, args.prompts_per_client = [1, 4], 2
    paired, shared = plan_runs(args, copies=2)
    assert not shared  # ABBA: each shape twice, on items of its own each time
    assert [(run.temperature, run.concurrency) for run in paired] == [
        (0.0, 1), (0.0, 1), (0.0, 4), (0.0, 4), (0.8, 1), (0.8, 1), (0.8, 4), (0.8, 4)]
    items = [repr(item) for run in paired for item in run.items]
    assert len(set(items)) == len(items)


def test_a_paired_start_is_measured_against_the_plain_server_beside_it():
    """Paired rows divide by their own plain server's runs of the same shape
    (geometric means over the ABBA runs), never by another pair's; bracketed
    rows by the plain servers just before and after their start."""
    def row(setting, tokens_per_s, start, pair=None, concurrency=4):
        return {"setting": setting, "output_throughput": tokens_per_s, "start": start,
                "concurrency": concurrency, "temperature": 0.8,
                **({"pair": pair} if pair else {})}

    rows = [row("plain", 100, 0, "a/0"), row("a", 90, 0, "a/0"), row("a", 160, 0, "a/0"),
            row("plain", 160, 0, "a/0"),
            row("plain", 50, 0, "b/0"), row("b", 50, 0, "b/0"), row("b", 50, 0, "b/0"),
            row("plain", 50, 0, "b/0"), row("a", 999, 0, "a/0", concurrency=16)]
    ratios = serving_ratios(rows)
    assert ratios[("a", 4, 0.8)] == [pytest.approx(1.2 / 1.264911, rel=1e-5)]
    assert ratios[("b", 4, 0.8)] == [pytest.approx(1.0)]
    assert ("a", 16, 0.8) not in ratios  # no plain run of that shape: no ratio
    bracketed = [row("plain", 100, 0), row("c", 150, 0), row("plain", 400, 1),
                 row("c", 100, 1), row("plain", 25, 2)]
    assert serving_ratios(bracketed)[("c", 4, 0.8)] == [pytest.approx(0.75), pytest.approx(1.0)]


def test_each_prompt_set_is_compared_on_its_own_requests():
    """A set's speed-up is its requests' tokens over their seconds against
    plain's same requests (every repeat), and its round sources (and the
    mechanism's share of its self-drafts) its own."""
    labels = ["code", "copy"]
    plain, ours = run_with("plain", [[100, 100]]), run_with("ngram", [[100, 100]])
    plain.request_decode = [(100, 1.0), (100, 1.0)] * 2  # two repeats
    ours.request_decode = [(100, 1.0), (100, 0.5), (100, 1.0), (100, 0.25)]
    ours.request_sources = [{"self_rounds": 3, "none_rounds": 1, "self_drafted": 8,
                             "self_accepted": 6, "mechanism_drafted": 2,
                             "mechanism_accepted": 1},
                            {"lookup_rounds": 2, "none_rounds": 2}]
    plain.request_sources = [{}, {}]
    plain_row, row = summarize([plain, ours], num_layers=30, batch_size=1, labels=labels)
    assert row["by_prompt_set"]["code"]["speedup"] == 1.0
    assert row["by_prompt_set"]["copy"]["speedup"] == round(200 / 0.75 / 100, 3)
    assert row["by_prompt_set"]["code"]["round_sources"] == {
        "self": 0.75, "lookup": 0.0, "none": 0.25}
    assert row["by_prompt_set"]["copy"]["round_sources"]["lookup"] == 0.5
    # Of the self-drafts, the mechanism's share and each part's acceptance.
    code = row["by_prompt_set"]["code"]
    assert (code["self_drafts_by_mechanism"], code["mechanism_acceptance"],
            code["base_acceptance"]) == (0.25, 0.5, 0.833)
    assert row["self_drafts_by_mechanism"] == 0.25
    assert row["by_prompt_set"]["copy"]["self_drafts_by_mechanism"] is None
    assert "round_sources" not in plain_row["by_prompt_set"]["copy"]
    assert "by_prompt_set" not in summarize([plain, ours], 30, 1, ["code", "code"])[1]


@pytest.mark.parametrize("model", ["smollm2-135m", "model-without-shipped-files"])
def test_every_method_default_is_its_name_alone_and_a_valid_config(model, model_dir,
                                                                   tiny_llama_dir):
    """The benchmark runs each method as a user who types only its name: the
    config is `{"method": name}`, and it makes an engine config for a model
    with shipped files (vocabulary, heads) and for one without any (AdaDecode
    there needs `heads`; SWIFT needs more layers than the small model's three)."""
    shipped = model == "smollm2-135m"
    path = model_dir if shipped else tiny_llama_dir
    configs = method_configs(path, SimpleNamespace(model=model, dtype="float32",
                                                   del_exits=None))
    methods = ("draft_verify", "del") + (("adadecode", "swift") if shipped else ())
    for name in methods:
        assert configs[name] == {"method": name}
    for name in (*methods, "recommended"):
        engine = EngineArgs(model=str(path), dtype="float32", max_model_len=512,
                            block_size=32, speculative_config=configs[name])
        config = engine.create_engine_config().speculative_config
        assert config.method == configs[name]["method"]


@pytest.mark.parametrize("diagnostics", [False, True])
def test_the_main_jobs_table_is_speed_acceptance_and_parity_in_one_sentence(diagnostics,
                                                                            monkeypatch):
    """Eight columns (the speed-up over plain and over ngram among them) and
    one sentence naming the fastest setting, its speed-up, ngram's and how
    many outputs matched; the cost model's columns only with --diagnostics."""
    plain, ngram, ours = (run_with("plain", [[100]]), run_with("ngram", [[120]]),
                          run_with("recommended", [[150]]))
    plain.texts, ngram.texts, ours.texts = ["a", "b"], ["a", "c"], ["a", "b"]
    rows = summarize([plain, ngram, ours], num_layers=30, batch_size=1)
    args = SimpleNamespace(model="m", dtype="float32", batch_size=1, max_tokens=8, repeats=1,
                           engine_starts=1, interleave=False, diagnostics=diagnostics)
    console = io.StringIO()
    monkeypatch.setattr(CONSOLE, "stream", console)
    print_table(rows, args, num_prompts=2)
    out = console.getvalue().splitlines()
    header = next(line for line in out if line.startswith("method"))
    assert ("S*" in header and "machine" in header) == diagnostics
    assert header.split()[:9] == ["method", "tok/s", "speed-up", "spread", "vs", "ngram",
                                  "accept", "acc", "len"]
    recommended = next(line for line in out if line.startswith("recommended "))
    assert recommended.split()[2:5] == ["1.50x", "1.50-1.50", "1.25x"]
    assert out[-1] == ("recommended decodes 1.50x as fast as plain vLLM here (vLLM's ngram: "
                       "1.20x), its outputs identical to plain vLLM's in 2/2 prompts.")
