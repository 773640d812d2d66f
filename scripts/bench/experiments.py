"""The papers' own experiments, each on one engine: AdaDecode's threshold
sweep, DEL's static-exit grid, its step-overhead variant and its trace."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from bench.presets import del_config
from bench.report import summarize
from bench.runner import CONSOLE, Run, measure, run_engines, shutdown, start


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
