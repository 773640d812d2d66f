"""What compiling SWIFT's learned set costs and buys, in a compiled engine.

Decodes the benchmark's prompts with SWIFT (a short search, drafting every
round) until the search ends, then reports how long requests waited while the
learned set compiled, the compiled draft step and the same set's uncompiled
step against a plain step (batch 1, profiling mode), and whether the outputs
after the swap equal those before it.

    python scripts/lab/swift_compile.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench package

from bench.runner import CONSOLE, shutdown, start
from bench.workload import benchmark_prompts
from tqdm import tqdm

from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.assets import ROOT, cpu_flags, fast_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-iterations", type=int, default=20,
                        help="SWIFT's search length (candidates)")
    parser.add_argument("--dtype", default=fast_dtype())
    parser.add_argument("--name", help="results file stem")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    model_dir = ROOT / "models" / args.model
    spec = {"method": "swift", "context_window": 16, "max_iterations": args.max_iterations,
            "cost_aware": False}
    llm = start(model_dir, spec, SimpleNamespace(dtype=args.dtype, eager=False))
    prompts = benchmark_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def decode() -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - started

    passes = []
    for _ in tqdm(range(10), desc="decoding until the search ends", file=CONSOLE):
        passes.append(decode())
        (report,) = llm.collective_rpc("selfspec_search")
        if report["tasks"]["default"]["done"]:
            break
    after = decode()
    (costs,) = llm.collective_rpc("selfspec_step_costs", kwargs={"uncompiled": True})
    shutdown(llm)
    result = {
        "command": "python scripts/lab/swift_compile.py " + " ".join(sys.argv[1:]),
        "cpu_flags": cpu_flags(), "model": args.model, "dtype": args.dtype,
        "search_done": report["tasks"]["default"]["done"], "drafting": report["drafting"],
        "compile_seconds": report["compile_seconds"],
        "pass_seconds": [round(seconds, 2) for _, seconds in passes + [after]],
        "outputs_unchanged": all(tokens == passes[0][0] for tokens, _ in passes + [after]),
        "step_costs": costs}
    print(f"{args.model} {args.dtype} (CPU flags: {' '.join(cpu_flags())})")
    print(f"search ended: {result['search_done']}; drafting {report['drafting']}")
    print(f"requests waited while the learned set compiled: {report['compile_seconds']}")
    print(f"plain step {1000 * costs['plain_step_s']:.1f} ms; learned set compiled "
          f"{1000 * costs['draft_step_s']:.1f} ms (c {costs['cost_ratio']:.2f}), uncompiled "
          f"{1000 * costs['uncompiled_draft_step_s']:.1f} ms "
          f"(c {costs['uncompiled_cost_ratio']:.2f})")
    print(f"outputs unchanged over {len(passes) + 1} passes: {result['outputs_unchanged']}")
    name = args.name or f"swift-compile-{args.model}-{args.dtype}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
