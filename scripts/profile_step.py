"""Where a decode step's time goes: plain vLLM against speculative configs.

Each engine decodes the benchmark's prompts `--batch-size` at a time (1: one
at a time; 16: a loaded server's batch, every request run to `--max-tokens`
so the batch stays full) at `--temperature`, while its worker
times the runner's pieces of every step (`selfspec_time_step_pieces`): the
forward with its input preparation, sampling, the drafter and bookkeeping.
A step's wall time comes from the requests' own token timestamps, so what is
left (the engine core's scheduling and output handling, and the messages
between the engine core and the worker) is the step minus the runner's
pieces. Declined rounds show up as the difference to plain that the drafter
and its glue cost while drafting nothing. With `--passes N` each engine
decodes the prompts N times and each pass's speed is shown: on these machines
some engines start with a slower forward than others' and speed up over
minutes (docs/results/kernels-and-machine.md), which a one-pass comparison
mistakes for a method's cost.

    python scripts/profile_step.py --methods plain,draft_verify,swift,ngram
    python scripts/profile_step.py --methods plain,recommended --batch-size 16 \
        --num-prompts 32 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

from bench.presets import method_configs
from bench.provenance import provenance
from bench.runner import CONSOLE, shutdown, start
from bench.workload import benchmark_prompts
from tqdm import tqdm

from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.assets import ROOT, cpu_flags, fast_dtype
from vllm_selfspec.diagnostics import DRAFTER_PIECES, RUNNER_PIECES


def batch_decode_time(outputs) -> tuple[int, float]:
    """Tokens after each request's first, and the seconds from the batch's
    last first token (every prefill done) to its last token; for one request,
    its decode time."""
    tokens = sum(output.metrics.num_generation_tokens - 1 for output in outputs)
    return tokens, (max(output.metrics.last_token_ts for output in outputs)
                    - max(output.metrics.first_token_ts for output in outputs))


def profile(model_dir, spec: dict | None, prompts: list[str], engine_args,
            max_tokens: int, passes: int, batch_size: int = 1,
            temperature: float = 0.0, operators: bool = False) -> dict:
    """Per-step milliseconds of each piece, and the step's own, over all
    passes; milliseconds per call of each piece; each pass's tokens/s and
    forward, in the order they ran; with `operators`, one more pass under the
    torch profiler: its top operators by self time, per decode step."""
    from vllm import SamplingParams

    llm = start(model_dir, spec, engine_args)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            ignore_eos=batch_size > 1)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up

    def decode_pass() -> tuple[int, float, dict]:
        """Every prompt decoded once: decode tokens, their seconds, and the
        step pieces the worker timed."""
        llm.collective_rpc("selfspec_time_step_pieces", args=(True,))
        tokens, seconds = 0, 0.0
        for start_index in range(0, len(prompts), batch_size):
            decoded, decode_seconds = batch_decode_time(llm.generate(
                prompts[start_index:start_index + batch_size], params, use_tqdm=False))
            tokens, seconds = tokens + decoded, seconds + decode_seconds
        return tokens, seconds, llm.collective_rpc("selfspec_time_step_pieces")[0]

    runs = [decode_pass() for _ in range(passes)]
    by_operator = None
    if operators:
        llm.collective_rpc("selfspec_profile_steps", args=(True,))
        *_, profiled_pieces = decode_pass()
        report = llm.collective_rpc("selfspec_profile_steps")[0]
        # Over the pass's decode steps; the prompts' prefills are in the
        # operators' times too (one step per prompt).
        decode_steps = profiled_pieces["execute_model"][0]
        by_operator = {"decode_steps": decode_steps,
                       "ms_per_step": report["self_ms"] / decode_steps,
                       "operators": [{**op, "ms_per_step": op["self_ms"] / decode_steps}
                                     for op in report["operators"]]}
    shutdown(llm)
    tokens, seconds = sum(run[0] for run in runs), sum(run[1] for run in runs)
    labels = {label for run in runs for label in run[2]}  # a pass may miss a piece
    pieces = {label: [sum(run[2].get(label, (0, 0.0))[i] for run in runs) for i in (0, 1)]
              for label in labels}
    steps = pieces["execute_model"][0]  # decode steps: what `seconds` spans
    per_step = {label: 1000 * total / steps for label, (_, total) in pieces.items()}
    step_ms = 1000 * seconds / steps
    per_step["engine_core_and_messages"] = (
        step_ms - per_step["execute_model"] - per_step["sample_tokens"])
    return {"tokens_per_s": tokens / seconds, "tokens_per_step": tokens / steps,
            "step_ms": step_ms, "steps": steps,
            "pieces_ms": {k: round(v, 3) for k, v in per_step.items()},
            "ms_per_call": {label: round(1000 * total / calls, 3)
                            for label, (calls, total) in pieces.items() if calls},
            "calls_per_step": {label: round(calls / steps, 3)
                               for label, (calls, _) in pieces.items()},
            "operators": by_operator,
            "passes": [{"tokens_per_s": round(t / s, 2), "execute_model_ms": round(
                1000 * p["execute_model"][1] / p["execute_model"][0], 3)} for t, s, p in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="plain,draft_verify",
                        help="benchmark.py's method names, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=fast_dtype())
    parser.add_argument("--passes", type=lambda v: max(int(v), 1), default=1,
                        help="decode the prompts this many times per engine; each pass's "
                             "tokens/s and forward time are printed in order, which shows "
                             "an engine whose speed drifts after it starts")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts decoded together (each run to --max-tokens)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--operators", action="store_true",
                        help="one more pass per engine under the torch profiler: its top "
                             "operators by self time per decode step")
    parser.add_argument("--name", help="results file stem")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer

    model_dir = ROOT / "models" / args.model
    engine_args = SimpleNamespace(dtype=args.dtype, eager=False, model=args.model,
                                  del_exits=None)
    configs = method_configs(model_dir, engine_args)
    prompts = benchmark_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    results = {name: profile(model_dir, configs[name], prompts, engine_args, args.max_tokens,
                             args.passes, args.batch_size, args.temperature, args.operators)
               for name in tqdm(args.methods.split(","), desc="engines", file=CONSOLE)}
    labels = ["step_ms", *RUNNER_PIECES, *(f"drafter.{name}" for name in DRAFTER_PIECES),
              "engine_core_and_messages"]
    print(f"{args.model} {args.dtype}, batch {args.batch_size}, temperature "
          f"{args.temperature}, ms per step (CPU flags: {' '.join(cpu_flags())})")
    print(f"{'piece':26}" + "".join(f"{name:>14}" for name in results))
    for label in labels:
        values = [r["step_ms"] if label == "step_ms" else r["pieces_ms"].get(label)
                  for r in results.values()]
        print(f"{label:26}" + "".join(
            f"{'-' if v is None else f'{v:.3f}':>14}" for v in values))
    print(f"{'tokens/s':26}" + "".join(f"{r['tokens_per_s']:>14.1f}" for r in results.values()))
    plain = results.get("plain")
    if plain:
        print(f"{'x plain':26}" + "".join(
            f"{r['tokens_per_s'] / plain['tokens_per_s']:>14.3f}" for r in results.values()))
    print("ms per call (calls per step):")
    for label in labels[1:-1]:
        values = [(r["ms_per_call"].get(label), r["calls_per_step"].get(label))
                  for r in results.values()]
        if any(v[0] is not None for v in values):
            print(f"{label:26}" + "".join(
                f"{'-':>14}" if v is None else f"{f'{v:.2f} ({c:.2f})':>14}" for v, c in values))
    for method, result in results.items():
        if result["operators"]:
            report = result["operators"]
            print(f"{method}: operators by self time, ms per decode step "
                  f"({report['ms_per_step']:.2f} in all; calls per step)")
            for op in report["operators"]:
                print(f"  {op['name'][:60]:62}{op['ms_per_step']:8.3f}"
                      f"{op['calls'] / report['decode_steps']:9.2f}")
    if args.passes > 1:
        print("per pass, tokens/s (execute_model ms):")
        for method, result in results.items():
            print(f"{method:26}" + "".join(
                f"{p['tokens_per_s']:>9.1f} ({p['execute_model_ms']:.2f})"
                for p in result["passes"]))
    name = args.name or f"step-pieces-{args.model}-{args.dtype}"
    command = "python scripts/profile_step.py " + " ".join(os.sys.argv[1:])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {**provenance(), "command": command.strip(), "model": args.model,
         "dtype": args.dtype, "prompts": len(prompts), "max_tokens": args.max_tokens,
         "passes": args.passes, "batch_size": args.batch_size,
         "temperature": args.temperature,
         "configs": {n: configs[n] for n in results}, "results": results}, indent=2))
    print(f"saved {RESULTS / name}.json", file=CONSOLE)


if __name__ == "__main__":
    main()
