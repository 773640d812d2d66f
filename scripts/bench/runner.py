"""Start vLLM engines (offline `LLM`) and decode the prompts on them, one at a
time or taking turns, into a `Run` per setting: speeds per repeat and start,
acceptance, the drafter's counters, token sources and step costs."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from bench.machine import drifted_starts, machine_speed, turns, typical_machine_speed
from vllm_selfspec.config import METHOD_MODULES
from vllm_selfspec.diagnostics import WORKER_EXTENSION


class Terminal:
    """Where progress bars, the table and its reading go: stderr, or the
    terminal kept aside once the engines' own logs go to a file (`--log-file`)."""

    def __init__(self) -> None:
        self.stream: TextIO = sys.stderr

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding: tqdm asks
        return getattr(self.stream, name)


CONSOLE = Terminal()


def send_engine_logs_to(path: Path) -> None:
    """Point this process's stdout and stderr, which vLLM's logging and every
    engine process inherit, at `path`, keeping the terminal as CONSOLE."""
    path.parent.mkdir(parents=True, exist_ok=True)
    CONSOLE.stream = os.fdopen(os.dup(2), "w", buffering=1)
    log = path.open("a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)


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
    if spec["method"] == "adadecode":
        costs["exit_gate"] = llm.collective_rpc("selfspec_exit_gate")[0]
    if spec["method"] == "swift":
        costs["search"] = llm.collective_rpc("selfspec_search")[0]
    costs["mechanism_gate"] = llm.collective_rpc("selfspec_mechanism_gate")[0]
    return costs


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
