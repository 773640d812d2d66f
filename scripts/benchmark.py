"""Compare plain vLLM, vLLM's own speculation and our methods on the same prompts.

Every engine runs in this one process, one after another (with --interleave
all at once, taking turns prompt by prompt), on the same prompts (HumanEval and
MT-bench questions in the model's chat template; --prompt-set every adds
GSM-style and copy-heavy requests, reported set by set), one request at a time,
greedy. Decode tokens/s is taken from vLLM's per-request timestamps (first to
last token), so prefill is excluded. Results go to
runs/<name>.json and a PNG plot (`$SELFSPEC_RESULTS_DIR` to write elsewhere).

    python scripts/benchmark.py --quick            # plain, ngram, recommended (setup's main job)
    python scripts/benchmark.py                    # + ngram, draft_model, full-depth draft
    python scripts/benchmark.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import CONFIGS_DIR, ROOT, cpu_flags, fast_dtype
from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.config import METHOD_MODULES
from vllm_selfspec.diagnostics import WORKER_EXTENSION
from vllm_selfspec.draft.heads import ExitHeads
from vllm_selfspec.integration.token_sources import MECHANISM_SOURCE, SOURCES
from vllm_selfspec.policy.payoff import StepCosts, costs_for, fit_round_costs

# Where progress bars, the table and its reading go: the terminal, also when
# the engines' own logs are sent to a file (`--log-file`).
CONSOLE = sys.stderr


def send_engine_logs_to(path: Path) -> None:
    """Point this process's stdout and stderr, which vLLM's logging and every
    engine process inherit, at `path`, keeping the terminal as CONSOLE."""
    global CONSOLE
    path.parent.mkdir(parents=True, exist_ok=True)
    CONSOLE = os.fdopen(os.dup(2), "w", buffering=1)
    log = path.open("a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)


def del_heads(model: str) -> str | None:
    """DEL's shipped exit heads: <model>-del (dense shallow exits, where tokens
    per loaded layer can pay) if there are some, else AdaDecode's <model>."""
    for name in (f"{model}-del", model):
        if (CONFIGS_DIR / "heads" / name).exists():
            return name
    return None


def del_config(args) -> dict:
    """DEL with the model's trained heads if it has them, else its own LM head
    at the `--del-exits` layers (as for LayerSkip-style models)."""
    if heads := del_heads(args.model):
        return {"method": "del", "heads": heads}
    if args.del_exits:
        return {"method": "del", "exit_layers": args.del_exits}
    return {"method": "del", "exit_layer_stride": 2}


# The target as its own draft over its own weights and whole vocabulary, 4
# tokens every round (no exit threshold, no cost-aware budget, no lookups):
# what a full-depth draft costs (c) and how often a low-precision one agrees
# with the target.
FULL_DEPTH = {"method": "draft_verify", "num_speculative_tokens": 4,
              "adaptive_threshold": False, "threshold": 0.0, "cost_aware": False,
              "draft_precision": "target", "draft_vocab": "full", "lookup": False}


# A second plain engine under another name: how far two identical engines'
# speeds differ (engine start, compile, CPU state), the noise floor of every
# ratio here.
PLAIN_AGAIN = "plain_again"


def method_configs(model_dir: Path, args) -> dict[str, dict | None]:
    config_file = args.model
    configs = {
        "plain": None,
        PLAIN_AGAIN: None,
        "draft_verify": {"method": "draft_verify", **(  # its shipped skip set, if any
            {"config_file": config_file} if (CONFIGS_DIR / f"{config_file}.json").exists()
            else {})},
        "draft_verify_full_depth": FULL_DEPTH,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4,
                  "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "draft_model_self": {"method": "draft_model", "model": str(model_dir),
                             "num_speculative_tokens": 4},
    }
    if (CONFIGS_DIR / "heads" / config_file).exists():  # trained exit heads
        configs["adadecode"] = {"method": "adadecode", "heads": config_file}
    configs["del"] = del_config(args)
    configs["swift"] = {"method": "swift"}
    configs["recommended"] = recommended_config(args.model)
    configs.update(cheap_draft_configs(args))
    return configs


def recommended_config(model: str) -> dict:
    """The README's one short config: lookup drafts where the request's own
    text offers them, else the whole model as its own draft over an int8 copy of
    its weights and its draft vocabulary; cost-aware (the default)."""
    vocab = {"draft_vocab": model} if (CONFIGS_DIR / "vocab" / f"{model}.json").exists() else {}
    return {"method": "draft_verify", "draft_precision": "int8", **vocab, "lookup": {}}


def cheap_draft_configs(args) -> dict[str, dict]:
    """The full-depth self-draft at each draft precision, with and without the
    model's draft vocabulary (int4 only where activations are bf16), and every
    method with int8 weights and the vocabulary but no lookups
    (`<method>_int8_vocab`)."""
    vocab = args.model if (CONFIGS_DIR / "vocab" / f"{args.model}.json").exists() else None
    precisions = ["target", "int8"] + (["int4"] if args.dtype == "bfloat16" else [])
    full_depth = FULL_DEPTH
    configs = {}
    for precision in precisions:
        for subset in ([None, vocab] if vocab else [None]):
            if precision == "target" and subset is None:
                continue  # draft_verify_full_depth
            name = f"full_depth_{precision}" + ("_vocab" if subset else "")
            configs[name] = {**full_depth, "draft_precision": precision,
                             **({"draft_vocab": subset} if subset else {})}
    cheap = {"draft_precision": "int8", "draft_vocab": vocab or "full", "lookup": False}
    for method in ("draft_verify", "adadecode", "del", "swift"):
        base = {"method": "draft_verify", "config_file": args.model} if (
            method == "draft_verify") else configs_for_method(method, args)
        if base is not None:
            configs[f"{method}_int8_vocab"] = {**base, **cheap}
    return configs


def configs_for_method(method: str, args) -> dict | None:
    if method == "adadecode":
        heads = CONFIGS_DIR / "heads" / args.model
        return {"method": "adadecode", "heads": args.model} if heads.exists() else None
    if method == "del":
        return del_config(args)
    return {"method": method}


@dataclass
class Run:
    name: str
    speculative_config: dict | None
    texts: list[str] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)  # one per repeat, all starts
    start_tokens_per_s: list[float] = field(default_factory=list)  # mean of each engine start
    start_machine_speed: list[float] = field(default_factory=list)  # median GB/s, each start
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    decode_tokens: int = 0
    first_start_decode_seconds: float = 0.0  # the start whose step costs are kept
    startup_s: float = 0.0
    step_costs: dict | None = None
    generated: int = 0  # first repeat, prefill token included
    draft_layers: float = 0.0  # first repeat; ours from the drafter's counters
    # (decode tokens, seconds) of every request, all repeats and starts, in prompt order
    request_decode: list[tuple[int, float]] = field(default_factory=list)
    search_iterations: list[int] = field(default_factory=list)  # SWIFT: after each request
    request_sources: list[dict] = field(default_factory=list)  # first repeat, token_sources
    retakes: list[dict] = field(default_factory=list)  # `retake_drifted_starts`

    @property
    def request_tokens_per_s(self) -> list[float]:
        return [tokens / seconds for tokens, seconds in self.request_decode]

    def tokens_per_loaded_layer(self, num_layers: int) -> float:
        """eTPL: generated tokens over layers run (each target forward runs all
        L layers and yields accepted + 1 tokens; plus the draft's layers)."""
        forwards = self.generated - self.accepted
        draft_layers = self.draft_layers
        if self.speculative_config and self.speculative_config["method"] == "draft_model":
            draft_layers = self.drafted * num_layers
        return self.generated / (forwards * num_layers + draft_layers)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verification step, the bonus token included."""
        return 1 + self.accepted / self.rounds if self.rounds else None

    @property
    def drafts_per_round(self) -> float | None:
        return self.drafted / self.rounds if self.rounds else None


def start(model_dir: Path, spec: dict | None, args):
    from vllm import LLM

    extra = {"per_request_spec_decode_metrics": "summary"} if spec else {}
    return LLM(model=str(model_dir), dtype=args.dtype, max_model_len=2048, seed=0,
               enforce_eager=args.eager, disable_log_stats=False,
               worker_extension_cls=WORKER_EXTENSION, speculative_config=spec, **extra)


def decode_time(output) -> tuple[int, float]:
    """Tokens after the first, and the seconds they took (prefill excluded)."""
    stats = output.metrics
    return stats.num_generation_tokens - 1, stats.last_token_ts - stats.first_token_ts


def accepted_tokens(spec_stats) -> int:
    """Accepted drafts from a request's acceptance histogram (j accepted, n rounds)."""
    return sum(j * n for j, n in enumerate(spec_stats.histogram))


def measure(llm, run: Run, prompts: list[str], args) -> None:
    """Decode the prompts one at a time, `args.repeats` times, into `run`."""
    measure_together([(run, llm)], prompts, args)


# Seconds an engine's worker keeps polling its queue after its last step
# (vLLM's SpinCondition) on the core the next engine's worker computes on:
# interleaved engines wait this long before the next one decodes.
READER_SPIN_S = 1.1


def measure_together(engines: list[tuple[Run, object]], prompts: list[str], args) -> None:
    """Decode the prompts, `args.repeats` times, on every engine: each batch
    of prompts on each engine in turn, the order changing from batch to batch
    (`turns`: each engine in every place and after every other equally often),
    so that a slow spell of the machine lands on all of them alike.
    Acceptance and token counts come from the first repeat of a run's first
    engine start; speeds from every repeat of every start."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    counted = []
    for run, llm in engines:
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        ours = run.speculative_config and run.speculative_config["method"] in METHOD_MODULES
        counted.append(llm.collective_rpc("selfspec_counters")[0] if ours else None)
    first_start = [not run.start_tokens_per_s for run, _ in engines]
    speeds: list[list[float]] = [[] for _ in engines]
    machine: list[list[float]] = [[machine_speed()] for _ in engines]
    batch = args.batch_size
    starts = range(0, len(prompts), batch)
    label = engines[0][0].name if len(engines) == 1 else "engines in turn"
    for repeat in range(args.repeats):
        tallies = [[0, 0.0, []] for _ in engines]  # decode tokens, seconds, texts
        for index, start in enumerate(tqdm(starts, desc=f"{label} #{repeat + 1}", leave=False,
                                           file=CONSOLE)):
            for place in turns(len(engines), repeat * len(starts) + index):
                if len(engines) > 1:
                    time.sleep(READER_SPIN_S)
                (run, llm), tally = engines[place], tallies[place]
                counting = first_start[place] and repeat == 0
                for output in llm.generate(prompts[start:start + batch], params,
                                           use_tqdm=False):
                    record_output(llm, run, output, tally, counting, batch)
                machine[place].append(machine_speed())
        for place, (run, llm) in enumerate(engines):
            tokens, seconds, texts = tallies[place]
            if first_start[place] and repeat == 0 and counted[place] is not None:
                after = llm.collective_rpc("selfspec_counters")[0]
                run.draft_layers = after["draft_layers"] - counted[place]["draft_layers"]
            speeds[place].append(tokens / seconds)
            if first_start[place]:
                run.first_start_decode_seconds += seconds
            run.decode_tokens = tokens
            run.texts = texts
    for place, (run, _) in enumerate(engines):
        run.tokens_per_s.extend(speeds[place])
        run.start_tokens_per_s.append(statistics.mean(speeds[place]))
        run.start_machine_speed.append(statistics.median(machine[place]))


# How far the machine's speed during an engine's start may stray from its
# speed during plain's same start before that start's ratio is flagged, and
# from the run's typical speed before `--retake-drifted-starts` takes it again.
MACHINE_TOLERANCE = 0.05

# Bytes of weights the machine-speed probe streams: beyond any cache, like a
# decode step's.
PROBE_BYTES = 256 * 2**20


@functools.cache
def _probe_operands():
    import torch

    rows = 4096
    return torch.randn(rows, PROBE_BYTES // 4 // rows), torch.randn(PROBE_BYTES // 4 // rows)


def machine_speed() -> float:
    """GB/s one thread streams through a float32 matrix-vector product over
    256 MB of weights, as a decode step streams its weights. These VMs' slow
    spells are in memory bandwidth while cache-resident work runs at full
    speed (docs/results/kernels-and-machine.md), so an engine start during
    which the probe read slower than during plain's has a ratio that is partly
    the machine's."""
    import torch

    weights, vector = _probe_operands()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's worker computes
    try:
        started = time.perf_counter()
        for _ in range(4):
            torch.mv(weights, vector)
        return 4 * PROBE_BYTES / (time.perf_counter() - started) / 1e9
    finally:
        torch.set_num_threads(threads)


def turns(num_engines: int, index: int) -> list[int]:
    """The engines' order for the index-th batch of prompts: the rows of a
    Williams design (a balanced Latin square, with the rows reversed too when
    the count is odd), so over a cycle of rows every engine decodes in every
    place equally often and right after each other engine equally often: a
    slow spell, or whatever an engine leaves behind for the next, lands on
    none of them more than on the others."""
    first_row = [(place // 2 + 1) if place % 2 else (num_engines - place // 2) % num_engines
                 for place in range(num_engines)]
    cycle = num_engines if num_engines % 2 == 0 else 2 * num_engines
    row = index % cycle
    order = [(engine + row) % num_engines for engine in first_row]
    return order if row < num_engines else order[::-1]


def record_output(llm, run: Run, output, tally: list, counting: bool, batch: int) -> None:
    """One request's decode speed, text and (when counting) drafts into `run`,
    and its tokens and seconds into `tally`."""
    decoded, decode_seconds = decode_time(output)
    run.request_decode.append((decoded, decode_seconds / batch))
    if run.speculative_config and run.speculative_config["method"] == "swift":
        search = llm.collective_rpc("selfspec_search")[0]["tasks"]
        run.search_iterations.append(sum(task["iterations"] for task in search.values()))
    tally[0] += decoded
    tally[1] += decode_seconds / batch  # requests of a batch decode together
    tally[2].append(output.outputs[0].text)
    if counting:
        run.generated += decoded + 1
    spec_stats = output.outputs[0].spec_decode_metrics
    if counting:  # one entry per request, so that entries line up with prompts
        run.request_sources.append(dict(spec_stats.token_sources) if spec_stats else {})
    if counting and spec_stats is not None:
        run.drafted += spec_stats.num_draft_tokens
        run.accepted += accepted_tokens(spec_stats)
        run.rounds += sum(spec_stats.histogram)


# `--prompt-set` names these, each `--num-prompts` requests; "every" is all
# kinds in one run, requests of each kind in turn.
PROMPT_SETS = {
    "mixed": prompt_sets.code_then_chat,
    "humaneval": prompt_sets.humaneval,
    "mtbench": prompt_sets.mtbench,
    "gsm": prompt_sets.gsm_style,
    "copy": prompt_sets.copy_heavy,
}
EVERY_SET = ("humaneval", "mtbench", "gsm", "copy")


def prompt_set_names(value: str) -> list[str]:
    """`--prompt-set`'s value: one set, a comma-separated list, or "every"."""
    names = list(EVERY_SET) if value == "every" else value.split(",")
    unknown = [name for name in names if name not in PROMPT_SETS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown prompt set {', '.join(unknown)}: choose from "
            f"{', '.join(PROMPT_SETS)} or every")
    return names


def benchmark_requests(num_prompts: int, sets: list[str]) -> list[tuple[str, str]]:
    """(set, question) for `num_prompts` questions of each set, the sets taking
    turns request by request (so that no set runs only on a fresh engine, or
    only after another set has shaped the drafter's records)."""
    questions = [PROMPT_SETS[name](num_prompts) for name in sets]
    return [(sets[index], question) for group in zip(*questions)
            for index, question in enumerate(group)]


def benchmark_prompts(tokenizer, num_prompts: int, sets: list[str] = ("mixed",)) -> list[str]:
    """The benchmark's prompts in the model's chat template: by default half
    HumanEval, half MT-bench ("mixed")."""
    return prompt_sets.as_chat(tokenizer, [question for _, question in
                                           benchmark_requests(num_prompts, list(sets))])


def run_engines(runs: list[Run], model_dir: Path, prompts: list[str], args) -> None:
    """Start an engine for each run and measure them together (one run: alone;
    several: the prompts decoded on each in turn, `measure_together`); at a
    run's first start also take the drafter's step costs, each engine in turn,
    once the previous engine's worker has stopped polling."""
    first_start = not runs[0].start_tokens_per_s
    engines = []
    for run in runs:
        started = time.perf_counter()
        engines.append((run, start(model_dir, run.speculative_config, args)))
        if first_start:
            run.startup_s = time.perf_counter() - started
    measure_together(engines, prompts, args)
    for run, llm in engines:
        if first_start:
            if len(engines) > 1:
                time.sleep(READER_SPIN_S)
            run.step_costs = step_costs(llm, run.speculative_config)
        shutdown(llm)


def engine_order(runs: list[Run], engine_starts: int) -> list[list[Run]]:
    """Every run once per start, each start in the next order of `turns`:
    neither a slow spell of the machine nor a place in the order (first
    after a previous engine's exit, or first of interleaved engines) lands
    on one method."""
    return [[runs[place] for place in turns(len(runs), start)] for start in range(engine_starts)]


def typical_machine_speed(runs: list[Run]) -> float:
    """The probe's median over every engine start of the run."""
    return statistics.median(speed for run in runs for speed in run.start_machine_speed)


def drifted_starts(runs: list[Run], typical: float) -> list[tuple[Run, int]]:
    """Each (run, start index) during which the probe read the machine more
    than MACHINE_TOLERANCE off `typical`: these VMs slow for minutes at a time
    (docs/results/kernels-and-machine.md), so such a start's ratio is partly
    the VM's."""
    return [(run, index) for run in runs for index, speed in enumerate(run.start_machine_speed)
            if abs(speed / typical - 1) > MACHINE_TOLERANCE]


def keep_nearer(run: Run, index: int, attempt: Run, typical: float) -> dict:
    """Put `attempt`'s one new start in place of `run`'s `index`-th when the
    probe read it nearer the typical machine speed: chosen by the machine,
    never by the speed measured, so slow and fast spells go alike. Returns
    the record of the retake."""
    old, new = run.start_machine_speed[index], attempt.start_machine_speed[-1]
    kept = abs(new / typical - 1) < abs(old / typical - 1)
    record = {"start": index + 1, "machine_GBps": [round(old, 2), round(new, 2)],
              "tokens_per_s": [round(run.start_tokens_per_s[index], 2),
                               round(attempt.start_tokens_per_s[-1], 2)],
              "kept": "retake" if kept else "first"}
    if kept:
        per_start = len(attempt.request_decode)  # every repeat of every prompt
        run.request_decode[index * per_start:(index + 1) * per_start] = attempt.request_decode
        repeats = len(attempt.tokens_per_s)
        run.tokens_per_s[index * repeats:(index + 1) * repeats] = attempt.tokens_per_s
        run.start_tokens_per_s[index] = attempt.start_tokens_per_s[-1]
        run.start_machine_speed[index] = new
    run.retakes.append(record)
    return record


def retake_drifted_starts(runs: list[Run], model_dir: Path, prompts: list[str], args) -> None:
    """Start each drifted engine start's engine again, alone, up to
    `args.retake_drifted_starts` times, keeping the start nearer the run's
    typical machine speed (`keep_nearer`). Retakes measure speed only: counts,
    texts and step costs stay those of the run's own starts."""
    typical = typical_machine_speed(runs)
    for _ in range(args.retake_drifted_starts):
        drifted = drifted_starts(runs, typical)
        for run, index in tqdm(drifted, desc="retakes of drifted starts", file=CONSOLE):
            # Its earlier starts copied in: not a first start, so nothing is counted.
            attempt = Run(run.name, run.speculative_config,
                          start_tokens_per_s=list(run.start_tokens_per_s))
            run_engines([attempt], model_dir, prompts, args)
            keep_nearer(run, index, attempt, typical)


def unbalanced_first_start(num_engines: int, engine_starts: int) -> str | None:
    """A warning when interleaved engines will not each start first equally
    often: the engine started first decodes slower than the rest on these
    machines (docs/results/kernels-and-machine.md), which a ratio against it
    would carry."""
    if num_engines < 2 or engine_starts % num_engines == 0:
        return None
    return (f"{num_engines} engines interleaved over {engine_starts} start(s): not every "
            f"engine starts first equally often, and the first-started engine has run "
            f"2-16 % slower here; --engine-starts {num_engines} (or a multiple) balances it")


def step_costs(llm, spec: dict | None) -> dict | None:
    """Our drafter's step and round costs (DEL: per exit; SWIFT: its search),
    and where a plain and a draft forward spend their time, by operator."""
    if spec is None or spec["method"] not in METHOD_MODULES:
        return None
    costs = llm.collective_rpc("selfspec_step_costs")[0]
    costs["rounds"] = llm.collective_rpc("selfspec_round_costs")[0]
    costs["forward_profile"] = llm.collective_rpc("selfspec_profile_forwards")[0]
    if spec["method"] == "del":
        costs["exit_costs"] = llm.collective_rpc("selfspec_exit_costs")[0]
    if spec["method"] == "swift":
        costs["search"] = llm.collective_rpc("selfspec_search")[0]
    return costs


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def threshold_sweep(model_dir: Path, prompts: list[str], plain: Run, args) -> list[dict]:
    """AdaDecode at each threshold in one engine (the threshold is read every
    round), against the plain run: the paper's Figure 5."""
    spec = {"method": "adadecode", "heads": args.model}
    llm = start(model_dir, spec, args)
    runs = []
    for threshold in tqdm(args.threshold_sweep, desc="thresholds", file=CONSOLE):
        llm.collective_rpc("selfspec_set_option", args=("threshold", threshold))
        run = Run(f"adadecode@{threshold}", {**spec, "threshold": threshold})
        measure(llm, run, prompts, args)
        runs.append(run)
    shutdown(llm)
    return summarize([plain, *runs], args.num_layers, args.batch_size)[1:]


def static_exit_grid(model_dir: Path, prompts: list[str], plain: Run, args) -> list[dict]:
    """DEL's baseline: a fixed exit layer E and draft length gamma (LayerSkip's
    LS(E-gamma)) for every E in args.exit_layers and gamma in args.del_grid, one
    engine."""
    spec = del_config(args)
    llm = start(model_dir, spec, args)
    runs = []
    points = [(e, g) for e in args.exit_layers for g in args.del_grid]
    for exit_layer, length in tqdm(points, desc="static exits", file=CONSOLE):
        llm.collective_rpc("selfspec_set_option", args=("exit_layer", exit_layer))
        llm.collective_rpc("selfspec_set_option", args=("draft_length", length))
        run = Run(f"static E={exit_layer} g={length}",
                  {**spec, "exit_layer": exit_layer, "draft_length": length})
        measure(llm, run, prompts, args)
        runs.append(run)
    shutdown(llm)
    return summarize([plain, *runs], args.num_layers, args.batch_size)[1:]


def del_with_step_overhead(model_dir: Path, prompts: list[str], args) -> Run:
    """DEL whose TPL counts a given fixed cost per forward (0: the paper's
    layer count) beside the default, measured one."""
    overhead = args.del_step_overhead
    run = Run(f"del o={overhead:g}", {**del_config(args), "step_overhead": overhead})
    run_engines([run], model_dir, prompts, args)
    return run


def del_trace(model_dir: Path, prompt: str, args) -> list[dict]:
    """DEL's choice every round over 256 tokens of one prompt (the paper's Figure 4)."""
    from vllm import SamplingParams

    llm = start(model_dir, del_config(args), args)
    llm.collective_rpc("selfspec_trace", args=(True,))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=256),
                 use_tqdm=False)
    (trace,) = llm.collective_rpc("selfspec_trace")
    shutdown(llm)
    (rounds,) = trace.values()
    return rounds


def round_sources(request_sources: list[dict]) -> dict:
    """How the requests' rounds drafted (self-draft, lookup, none: declined),
    as shares of all their rounds, how many requests used each, and the share
    of the self-drafted tokens that the method's own mechanism made (skipped
    layers, an early exit) rather than the full-depth base, with the
    acceptance of each (our methods' per-request token_sources)."""
    rounds, tokens = Counter(), Counter()
    for sources in request_sources:
        rounds.update({s: sources.get(f"{s}_rounds", 0) for s in SOURCES})
        tokens.update({key: value for key, value in sources.items()
                       if key.endswith(("_drafted", "_accepted"))})
    total = sum(rounds.values())
    if not total:
        return {}
    mechanism = tokens[f"{MECHANISM_SOURCE}_drafted"]
    base = tokens["self_drafted"] - mechanism
    base_accepted = tokens["self_accepted"] - tokens[f"{MECHANISM_SOURCE}_accepted"]
    return {"round_sources": {s: round(n / total, 3) for s, n in rounds.items()},
            "requests_using": {s: sum(bool(r.get(f"{s}_rounds")) for r in request_sources)
                               for s in rounds},
            "self_drafts_by_mechanism": (round(mechanism / tokens["self_drafted"], 3)
                                         if tokens["self_drafted"] else None),
            "mechanism_acceptance": (round(tokens[f"{MECHANISM_SOURCE}_accepted"] / mechanism, 3)
                                     if mechanism else None),
            "base_acceptance": round(base_accepted / base, 3) if base else None}


def by_prompt_set(run: Run, plain: Run, labels: list[str]) -> dict[str, dict]:
    """Each prompt set's decode tokens/s over its requests (all repeats), the
    speed-up over plain on the same requests, and how its requests' rounds
    drafted."""
    def of_set(items: list, name: str) -> list:
        return [item for index, item in enumerate(items)
                if labels[index % len(labels)] == name]

    def speed(decoded: list[tuple[int, float]]) -> float:
        return sum(tokens for tokens, _ in decoded) / sum(seconds for _, seconds in decoded)

    sets = {}
    for name in dict.fromkeys(labels):
        tokens_per_s = speed(of_set(run.request_decode, name))
        sets[name] = {"tokens_per_s": round(tokens_per_s, 2),
                      "speedup": round(tokens_per_s / speed(of_set(plain.request_decode, name)), 3),
                      **round_sources(of_set(run.request_sources, name))}
    return sets


def summarize(runs: list[Run], num_layers: int, batch_size: int,
              labels: list[str] | None = None) -> list[dict]:
    """One row per run; with `labels` (each prompt's set) naming several sets,
    also each set's speed-up and round sources (`by_prompt_set`)."""
    plain = next(r for r in runs if r.name == "plain")
    base = statistics.mean(plain.tokens_per_s)
    rows = []
    for run in runs:
        speed = statistics.mean(run.tokens_per_s)
        # Spread over engine starts when there are several (each against
        # plain's same start; plain's own starts against their mean), else
        # over the repeats of the one start.
        if len(run.start_tokens_per_s) < 2:
            spread = [repeat / base for repeat in run.tokens_per_s]
        elif run is plain:
            spread = [start / base for start in run.start_tokens_per_s]
        else:
            spread = [ours / theirs for ours, theirs in
                      zip(run.start_tokens_per_s, plain.start_tokens_per_s)]
        row = {
            "method": run.name,
            "tokens_per_s": round(speed, 2),
            "tokens_per_s_runs": [round(x, 2) for x in run.tokens_per_s],
            "tokens_per_s_starts": [round(x, 2) for x in run.start_tokens_per_s],
            "speedup": round(speed / base, 3),
            "speedup_spread": [round(min(spread), 3), round(max(spread), 3)],
            "acceptance": _round(run.acceptance),
            "mean_accepted_length": _round(run.mean_accepted_length),
            "drafts_per_round": _round(run.drafts_per_round),
            "accepted_token_share": _round(run.accepted / run.decode_tokens
                                           if run.drafted else None),
            "rejection_rate": _round(1 - run.acceptance if run.drafted else None),
            "identical_to_plain": f"{sum(a == b for a, b in zip(run.texts, plain.texts))}"
                                  f"/{len(plain.texts)}",
            **round_sources(run.request_sources),
            "eTPL": round(run.tokens_per_loaded_layer(num_layers), 4),
            "startup_s": round(run.startup_s, 1),
        }
        if run.start_machine_speed:
            row.update(machine_rows(run, plain))
        if run.retakes:
            row["retakes"] = run.retakes
        if labels and len(set(labels)) > 1:
            row["by_prompt_set"] = by_prompt_set(run, plain, labels)
        if run.step_costs:
            forward_cost = run.step_costs["cost_ratio"]
            row["forward_cost_ratio"] = round(forward_cost, 3)
            row["sublayers_run"] = round(run.step_costs["fraction_of_sublayers_run"], 3)
            # A setting that never drafted (it declined every round) has no S*.
            if run.rounds:
                row["ideal_speedup_forwards"] = round(
                    run.mean_accepted_length / (1 + run.drafts_per_round * forward_cost), 3)
            costs = engine_round_costs(run, base, batch_size)
            if costs is not None and run.rounds:
                row["draft_step_cost_ratio"] = round(costs.per_draft, 3)
                row["round_overhead"] = round(costs.round_overhead, 3)
                ideal = run.mean_accepted_length / (
                    1 + costs.round_overhead + run.drafts_per_round * costs.per_draft)
                row["ideal_speedup_S*"] = round(ideal, 3)
                row["measured_over_S*"] = round(speed / base / ideal, 3)
            shared = run.step_costs["rounds"]["shared"]
            engine = costs_for({b: StepCosts(**c) for b, c in shared.items()},
                               batch_size) if shared else None
            if engine is not None and engine.lookup_overhead is not None:
                # What the engine's own lookup rounds say a looked-up token costs.
                row["lookup_token_cost"] = round(engine.per_verified, 3)
                row["lookup_round_overhead"] = round(engine.lookup_overhead, 3)
            row["draft_copy_MB"] = round(run.step_costs["draft_copy_bytes"] / 1e6, 1)
            row["draft_copy_share"] = round(run.step_costs["draft_copy_bytes"]
                                            / run.step_costs["model_bytes"], 3)
        if run.step_costs and "search" in run.step_costs:  # SWIFT's on-line search
            search = run.step_costs["search"]
            row["optimise_share_of_decode"] = round(  # one engine's search, its decoding
                search["optimise_seconds"] / run.first_start_decode_seconds, 3)
            row["search_candidates"] = sum(t["iterations"] for t in search["tasks"].values())
            row["search_futile_rounds"] = search["futile_rounds"]
        rows.append(row)
    return rows


def machine_rows(run: Run, plain: Run) -> dict:
    """The machine's speed during each of the run's starts and, but for plain,
    against its speed during plain's same start. Not divided out of the
    speed-up: how decoding slows with the probe's bandwidth is not known."""
    row = {"machine_GBps_starts": [round(x, 2) for x in run.start_machine_speed]}
    if run is not plain:
        row["machine_vs_plain_starts"] = [
            round(ours / theirs, 3)
            for ours, theirs in zip(run.start_machine_speed, plain.start_machine_speed)]
    return row


def engine_round_costs(run: Run, plain_tokens_per_s: float, batch_size: int
                       ) -> StepCosts | None:
    """c (per draft token, its verification share included) and a drafted
    round's fixed extra F, both in plain steps, from the rounds the engine
    timed at this batch size; the plain step from the plain run (batch_size
    tokens per step). The profiling-mode ratio stands in for c where every
    round drafted the same count."""
    rounds = run.step_costs["rounds"]["drafted"].get(batch_size, [])
    if not rounds:
        return None
    plain_step_s = batch_size / plain_tokens_per_s
    return fit_round_costs([steps for steps, _ in rounds],
                           [seconds / plain_step_s - 1 for _, seconds in rounds],
                           StepCosts(per_draft=run.step_costs["cost_ratio"]))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    speedups = [r["speedup"] for r in rows]
    errors = [[r["speedup"] - r["speedup_spread"][0] for r in rows],
              [r["speedup_spread"][1] - r["speedup"] for r in rows]]
    left.bar(names, speedups, yerr=errors, color="tab:blue", capsize=4)
    ideal = [(i, r["ideal_speedup_S*"]) for i, r in enumerate(rows)
             if "ideal_speedup_S*" in r]
    if ideal:
        left.scatter(*zip(*ideal), color="tab:red", zorder=3, label="ideal S*")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("decode speed-up vs plain vLLM (batch 1)")
    left.tick_params(axis="x", rotation=30)
    if ideal:
        left.legend()
    accept = [r["acceptance"] or 0 for r in rows]
    right.bar(names, accept, color="tab:green")
    right.set_ylabel("draft acceptance rate")
    right.set_ylim(0, 1.05)
    right.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_prompt_sets(rows: list[dict], path: Path, title: str) -> None:
    """Each method's speed-up over plain vLLM, one group of bars per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(rows[0]["by_prompt_set"])
    methods = rows[1:]
    width = 0.8 / max(len(methods), 1)
    fig, axis = plt.subplots(figsize=(12, 4.5))
    for index, row in enumerate(methods):
        axis.bar([position + index * width for position in range(len(sets))],
                 [row["by_prompt_set"][name]["speedup"] for name in sets], width,
                 label=row["method"])
    axis.set_xticks([position + width * (len(methods) - 1) / 2
                     for position in range(len(sets))], sets)
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.axhline(0.97, color="tab:red", lw=0.8, ls="--", label="0.97x plain")
    axis.set_ylabel("decode speed-up vs plain vLLM (batch 1)")
    axis.legend(fontsize=7, ncol=2)
    axis.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_sweep(rows: list[dict], path: Path, model: str) -> None:
    """Speed-up, early-prediction rate and rejection rate against the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = [float(r["method"].split("@")[1]) for r in rows]
    fig, axis = plt.subplots(figsize=(6.5, 4))
    axis.plot(thresholds, [r["speedup"] for r in rows], "o-", label="speed-up vs plain")
    axis.plot(thresholds, [r["accepted_token_share"] or 0 for r in rows], "s-",
              label="early-prediction rate (kept early tokens / tokens)")
    axis.plot(thresholds, [r["rejection_rate"] or 0 for r in rows], "^-",
              label="rejection rate (rejected / early tokens)")
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.set_xlabel("AdaDecode threshold")
    axis.set_title(f"{model}: AdaDecode threshold sweep (batch 1)")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_del_trace(rounds: list[dict], path: Path, model: str) -> None:
    """Exit layer, threshold tau and estimated acceptance per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(rounds))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.step(steps, [r["exit_layer"] if r["max_drafts"] else 0 for r in rounds],
             where="post", color="tab:purple")
    top.set_ylabel("exit layer E\n(0: no draft)")
    bottom.plot(steps, [r["threshold"] for r in rounds], label="threshold tau_E")
    bottom.plot(steps, [r["acceptance"] for r in rounds], label="estimated alpha_E")
    bottom.set_xlabel("speculative round")
    bottom.set_ylim(0, 1)
    bottom.legend(fontsize=8)
    top.set_title(f"{model}: DEL's choices over one request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_swift_search(run: Run, plain: Run, path: Path, model: str) -> None:
    """The paper's Figure 6: matchness of each scored candidate and of the
    incumbent over the search, and each request's speed-up over plain vLLM on
    the same prompt and repeat, against the search iterations done by then."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = run.step_costs["search"]["tasks"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    for task, search in tasks.items():
        history = search["history"]
        top.scatter([h["iteration"] for h in history], [h["score"] for h in history],
                    s=4, alpha=0.3, label=f"{task}: candidate")
        top.step([h["iteration"] for h in history], [h["incumbent_score"] for h in history],
                 where="post", label=f"{task}: incumbent")
        windows = search["windows"]
        top.plot([w["iteration"] for w in windows], [w["uniform"] for w in windows], "x",
                 color="black", label=f"{task}: uniform set (same window)")
    top.set_xlabel("candidates scored")
    top.set_ylabel("matchness")
    top.set_ylim(0, 1.02)
    top.legend(fontsize=7)
    speedups = [ours / base for ours, base in
                zip(run.request_tokens_per_s, plain.request_tokens_per_s)]
    bottom.plot(range(1, len(speedups) + 1), speedups, "o-", label="speed-up vs plain")
    searching = [i + 1 for i, n in enumerate(run.search_iterations)
                 if i == 0 or n > run.search_iterations[i - 1]]
    bottom.axvspan(0.5, max(searching) + 0.5, color="tab:orange", alpha=0.15,
                   label="search running")
    bottom.axhline(1.0, color="grey", lw=0.8)
    bottom.set_xlabel("request (one at a time, every repeat)")
    bottom.set_ylabel("decode speed-up")
    bottom.legend(fontsize=7)
    top.set_title(f"{model}: SWIFT's on-line search while serving")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--diagnostics", action="store_true",
                        help="also print the machine probe, the cost model's c, F and S* and "
                             "how rounds drafted (self/lookup/none)")
    parser.add_argument("--quick", action="store_true",
                        help="plain, ngram and the recommended setting on 4+4 prompts, "
                             "64 tokens; engine logs to a file")
    parser.add_argument("--methods", help="comma-separated subset of the methods")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                        help="also run this speculative config under NAME (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=8, help="per prompt set")
    parser.add_argument("--prompt-set", type=prompt_set_names, default=["mixed"],
                        help="mixed (default): HumanEval + MT-bench questions; humaneval; "
                             "mtbench; gsm: GSM-style math problems; copy: requests whose "
                             "answers repeat their prompts (code edits, rewrites); several "
                             "comma-separated, or every (humaneval,mtbench,gsm,copy): "
                             "--num-prompts of each, taking turns, each set reported apart")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-starts", type=int, default=1,
                        help="start every engine this many times, in turn (each start in "
                             "another order, as --interleave's batches); the spread is "
                             "then over starts (each against plain's same start), which "
                             "moves more than repeats within one start; with "
                             "--interleave, as many starts as engines lets each start "
                             "first once (the first-started engine runs slower)")
    parser.add_argument("--interleave", action="store_true",
                        help="start every engine at once and decode each batch of prompts "
                             "on each in turn (each engine in every place and after every other "
                             "equally often): a slow spell of the "
                             "machine then lands on all methods alike, which engines started "
                             "one after another cannot promise (memory: each engine holds "
                             "its weights and VLLM_CPU_KVCACHE_SPACE, 2 GiB by default)")
    parser.add_argument("--retake-drifted-starts", type=int, default=0, metavar="N",
                        help="after the last start, start again (alone, up to N times) "
                             "each engine whose start ran while the machine probe read "
                             f"more than {100 * MACHINE_TOLERANCE:g} %% off the run's median, "
                             "and keep whichever "
                             "start ran nearer it (chosen by the probe, not by speed); "
                             "the JSON lists every retake under its row's `retakes`")
    parser.add_argument("--dtype", default=fast_dtype(),
                        help="(default: bfloat16 where the hardware has it, else float32)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--log-file", type=Path,
                        help="send the engines' logs here (default with --quick: "
                             "runs/logs/<name>.log; otherwise the terminal)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="requests decoded together (tokens/s then counts all of them)")
    parser.add_argument("--name", help="results file stem")
    parser.add_argument("--threshold-sweep", type=lambda v: [float(x) for x in v.split(",")],
                        help="also sweep AdaDecode's threshold, e.g. 0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--del-grid", type=lambda v: [int(x) for x in v.split(",")],
                        help="also run static early exit at every exit of --del-grid-exits "
                             "with these draft lengths, e.g. 1,2,4 (DEL's baseline)")
    parser.add_argument("--del-grid-exits", type=lambda v: [int(x) for x in v.split(",")],
                        help="exit layers of the static grid (default: the heads' exits)")
    parser.add_argument("--del-exits", type=lambda v: [int(x) for x in v.split(",")],
                        help="without trained heads: DEL's candidate exits for the own LM "
                             "head (default every 2nd layer; each costs an LM-head pass "
                             "per round)")
    parser.add_argument("--del-step-overhead", metavar="LAYERS", type=float,
                        help="also run del with this step_overhead (0: the paper's layer "
                             "count; default del measures it)")
    parser.add_argument("--del-trace", action="store_true",
                        help="also plot DEL's exit layer and threshold over one request "
                             "whose text turns from code to prose")
    args = parser.parse_args()
    if args.interleave and (args.del_step_overhead is not None or args.threshold_sweep
                            or args.del_grid):
        parser.error("--interleave runs the methods' engines together; --del-step-overhead, "
                     "--threshold-sweep and --del-grid start engines of their own, one at a "
                     "time: run them without --interleave, or name the configs with --config")
    if args.interleave and args.retake_drifted_starts:
        parser.error("--retake-drifted-starts starts one engine again alone; interleaved "
                     "engines share the machine's spells: use one of the two")
    if args.quick:
        args.methods = args.methods or "plain,ngram,recommended"
        args.max_tokens, args.repeats = 64, 1

    name = args.name or f"{args.model}-{args.dtype}{'-quick' if args.quick else ''}"
    if args.quick and args.log_file is None:
        args.log_file = RESULTS / "logs" / f"{name}.log"
    if args.log_file is not None:
        print(f"engine logs: {args.log_file}", file=CONSOLE)
        send_engine_logs_to(args.log_file)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model_dir = ROOT / "models" / args.model
    if not model_dir.exists():
        raise SystemExit(f"{model_dir} is missing: python scripts/build_model.py {args.model}")
    from transformers import AutoTokenizer

    args.num_layers = json.loads((model_dir / "config.json").read_text())[
        "num_hidden_layers"]
    heads = del_heads(args.model)
    args.exit_layers = args.del_grid_exits or (
        ExitHeads.open(str(CONFIGS_DIR / "heads" / heads)).exit_layers if heads else [])

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = benchmark_requests(args.num_prompts, args.prompt_set)
    labels = [name for name, _ in requests]
    prompts = prompt_sets.as_chat(tokenizer, [question for _, question in requests])

    configs = method_configs(model_dir, args)
    extra = dict(item.split("=", 1) for item in args.config)
    configs.update({name: json.loads(spec) for name, spec in extra.items()})
    chosen = args.methods.split(",") if args.methods else list(configs)
    chosen += [name for name in extra if name not in chosen]
    if "plain" not in chosen:
        chosen.insert(0, "plain")
    runs = [Run(name, configs[name]) for name in chosen]
    start_orders = engine_order(runs, args.engine_starts)
    imbalance = unbalanced_first_start(len(runs), args.engine_starts) if args.interleave else None
    if imbalance:
        print(f"warning: {imbalance}", file=CONSOLE)
    if args.interleave:
        for order in tqdm(start_orders, desc="engine starts", file=CONSOLE):
            run_engines(order, model_dir, prompts, args)
    else:
        for run in tqdm([run for order in start_orders for run in order], desc="engines",
                        file=CONSOLE):
            run_engines([run], model_dir, prompts, args)
        retake_drifted_starts(runs, model_dir, prompts, args)
    if args.del_step_overhead is not None:
        runs.append(del_with_step_overhead(model_dir, prompts, args))

    rows = summarize(runs, args.num_layers, args.batch_size, labels)
    sweep = threshold_sweep(model_dir, prompts, runs[0], args) if args.threshold_sweep else []
    grid = static_exit_grid(model_dir, prompts, runs[0], args) if args.del_grid else []
    trace = del_trace(model_dir, prompt_sets.as_chat(
        tokenizer, [prompt_sets.CODE_THEN_STORY])[0], args) if args.del_trace else []
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python scripts/benchmark.py " + " ".join(
        a for a in os.sys.argv[1:])
    payload = {"command": command.strip(), "model": args.model, "dtype": args.dtype,
               "cpu_flags": cpu_flags(), "batch_size": args.batch_size,
               "eager": args.eager, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "prompt_sets": args.prompt_set, "prompt_set_of_each": labels,
               "repeats": args.repeats, "engine_starts": args.engine_starts,
               "interleaved": args.interleave,
               "retake_drifted_starts": args.retake_drifted_starts,
               "start_orders": [[run.name for run in order] for order in start_orders],
               "rows": rows,
               "threshold_sweep": sweep,
               "static_exit_grid": grid, "del_trace": trace,
               "configs": {r.name: r.speculative_config for r in runs},
               "step_costs": {r.name: r.step_costs for r in runs if r.step_costs},
               "per_request": {r.name: {"tokens_per_s": [round(x, 2) for x in
                                                         r.request_tokens_per_s],
                                        "token_sources": r.request_sources,
                                        "search_iterations": r.search_iterations}
                               for r in runs}}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    plot(rows, RESULTS / f"{name}.png", f"{args.model} ({args.dtype}), {len(prompts)} "
         f"prompts x {args.max_tokens} tokens, batch {args.batch_size}")
    if "by_prompt_set" in rows[0]:
        plot_prompt_sets(rows, RESULTS / f"{name}-sets.png", f"{args.model} ({args.dtype}), "
                         f"{args.num_prompts} prompts per set x {args.max_tokens} tokens")
    if sweep:
        plot_sweep(sweep, RESULTS / f"{name}-adadecode-threshold.png", args.model)
    if trace:
        plot_del_trace(trace, RESULTS / f"{name}-trace.png", args.model)
    for run in runs:
        if run.search_iterations:
            plot_swift_search(run, runs[0], RESULTS / f"{name}-search.png", args.model)
    print_table(rows + sweep + grid, args, len(prompts))
    if imbalance:
        print(f"warning: {imbalance}", file=CONSOLE)
    print(f"saved {RESULTS / name}.json and .png", file=CONSOLE)


def print_table(rows: list[dict], args, num_prompts: int) -> None:
    """What a user reads: tokens/s, the speed-up over plain with its spread,
    acceptance and whether outputs match plain's; with --diagnostics also the
    machine probe, the cost model's c, F and S*, and how rounds drafted."""
    print(f"\n{args.model} {args.dtype}: decode tokens/s at batch "
          f"{args.batch_size} ({num_prompts} prompts, {args.max_tokens} new tokens, "
          f"{args.repeats} repeats x {args.engine_starts} engine starts"
          f"{', interleaved' if args.interleave else ''}); CPU flags: "
          f"{' '.join(cpu_flags())}", file=CONSOLE)
    header = ["method", "tok/s", "speed-up", "spread", "accept", "acc len", "identical"]
    line = "{:<26}{:>7}{:>9}{:>12}{:>8}{:>9}{:>10}"
    if args.diagnostics:
        header += ["machine", "c", "F", "S*", "meas/S*", "rounds self/lookup/none %",
                   "mechanism % (acc) / base acc"]
        line += "{:>8}{:>6}{:>6}{:>6}{:>8}  {:<26}{}"
    print(line.format(*header), file=CONSOLE)
    for row in rows:
        cells = [row["method"], row["tokens_per_s"], f"{row['speedup']:.2f}x",
                 "{:.2f}-{:.2f}".format(*row["speedup_spread"]), _fmt(row["acceptance"]),
                 _fmt(row["mean_accepted_length"]), row["identical_to_plain"]]
        if args.diagnostics:
            machine = row.get("machine_vs_plain_starts")
            cells += [
                _fmt(statistics.geometric_mean(machine) if machine else None),
                _fmt(row.get("draft_step_cost_ratio")), _fmt(row.get("round_overhead")),
                _fmt(row.get("ideal_speedup_S*")), _fmt(row.get("measured_over_S*")),
                "/".join(f"{100 * share:.0f}" for share in row["round_sources"].values())
                if "round_sources" in row else "-", _mechanism_cell(row)]
        print(line.format(*cells), file=CONSOLE)
    if "by_prompt_set" in rows[0]:
        print_prompt_sets(rows)
    print(reading(rows, args.dtype), file=CONSOLE)
    for warning in machine_warnings(rows):
        print(f"warning: {warning}", file=CONSOLE)


def _mechanism_cell(row: dict) -> str:
    """The share of self-drafts the method's mechanism made, its acceptance,
    and the full-depth base's acceptance."""
    share = row.get("self_drafts_by_mechanism")
    if share is None:
        return "-"
    return (f"{100 * share:.0f} ({_fmt(row['mechanism_acceptance'])}) / "
            f"{_fmt(row['base_acceptance'])}")


def machine_warnings(rows: list[dict]) -> list[str]:
    """One sentence per engine start during which the machine ran at another
    speed than during plain's same start: that start's ratio is partly the VM's."""
    warnings = []
    for row in rows:
        for start, ratio in enumerate(row.get("machine_vs_plain_starts", []), 1):
            if abs(ratio - 1) > MACHINE_TOLERANCE:
                warnings.append(
                    f"the machine ran at {ratio:.2f}x its speed during plain's start {start} "
                    f"while {row['method']} decoded (probe: {row['machine_GBps_starts'][start - 1]}"
                    f" GB/s): that start's ratio measures the machine as much as the method")
    return warnings


def print_prompt_sets(rows: list[dict]) -> None:
    """Speed-up per prompt set and, for the sets, how rounds drafted."""
    sets = list(rows[0]["by_prompt_set"])
    line = "{:<26}" + "{:>24}" * len(sets)
    print("\nby prompt set: speed-up (rounds self/lookup/none %)", file=CONSOLE)
    print(line.format("method", *sets), file=CONSOLE)
    for row in rows[1:]:
        cells = []
        for name in sets:
            entry = row["by_prompt_set"][name]
            sources = "/".join(f"{100 * share:.0f}" for share in
                               entry["round_sources"].values()) if "round_sources" in entry else "-"
            cells.append(f"{entry['speedup']:.2f}x ({sources})")
        print(line.format(row["method"], *cells), file=CONSOLE)


def reading(rows: list[dict], dtype: str) -> str:
    """The table in one plain sentence (and one more when outputs differ)."""
    best = max(rows[1:], key=lambda row: row["speedup"], default=None)
    if best is None:
        return ""
    text = f"\n{best['method']} decodes {best['speedup']:.2f}x as fast as plain vLLM here"
    ngram = next((row for row in rows if row["method"] == "ngram"), None)
    if ngram is not None and ngram is not best:
        text += f" (vLLM's ngram: {ngram['speedup']:.2f}x)"
    text += f", its outputs identical to plain vLLM's in {best['identical_to_plain']} prompts."
    same, total = best["identical_to_plain"].split("/")
    if same != total and dtype != "float32":
        text += (f" In {dtype} a verification scores several tokens at once and its rounding "
                 "can flip a near-tie (vLLM's own methods do too); in float32 outputs are "
                 "identical, which the tests check.")
    return text


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
