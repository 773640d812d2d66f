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
import json
import os
import sys
from pathlib import Path

from bench.experiments import del_trace, del_with_step_overhead, static_exit_grid, threshold_sweep
from bench.machine import MACHINE_TOLERANCE, engine_order, unbalanced_first_start
from bench.plots import plot, plot_del_trace, plot_prompt_sets, plot_sweep, plot_swift_search
from bench.presets import del_heads, method_configs
from bench.provenance import provenance
from bench.report import print_table, summarize
from bench.runner import CONSOLE, Run, retake_drifted_starts, run_engines, send_engine_logs_to
from bench.workload import benchmark_requests, prompt_set_names
from tqdm import tqdm

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import CONFIGS_DIR, ROOT, fast_dtype
from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.draft.heads import ExitHeads


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
    command = "python scripts/benchmark.py " + " ".join(sys.argv[1:])
    payload = {**provenance(), "command": command.strip(), "model": args.model,
               "dtype": args.dtype, "batch_size": args.batch_size,
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


if __name__ == "__main__":
    main()
