"""Measure a running `vllm serve` with vLLM's own `vllm bench serve`.

Writes the benchmark's prompts (HumanEval and MT-bench, a local JSONL file in
the `custom` dataset format: {"prompt": ..., "output_tokens": N}), starts
`vllm serve` with a speculative config on loopback, and runs

    vllm bench serve --backend openai --dataset-name custom --dataset-path PROMPTS ...

against it; vLLM's report (throughput, TTFT/TPOT and its "Speculative Decoding"
section read from the server's /metrics) is printed and saved.

    python scripts/bench_serve.py --spec '{"method": "draft_verify", "draft_precision": "int8"}'
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from serving import vllm_serve

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import ROOT, fast_dtype

RESULTS = ROOT / "results"


def write_prompts(path: Path, count: int, output_tokens: int) -> Path:
    questions = prompt_sets.code_then_chat(count)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": q, "output_tokens": output_tokens}) + "\n"
                            for q in questions))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="name under models/")
    parser.add_argument("--spec", type=json.loads, help="speculative config (JSON)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--dtype", default=fast_dtype())
    parser.add_argument("--name", default="bench-serve")
    args = parser.parse_args()
    model_dir = ROOT / "models" / args.model
    logs = RESULTS / "logs"
    prompts = write_prompts(logs / f"{args.name}-prompts.jsonl", args.num_prompts,
                            args.output_tokens)
    server_args = ["--dtype", args.dtype, "--max-model-len", "2048", "--seed", "0"]
    with vllm_serve(model_dir, args.spec, logs / f"{args.name}-server.log", server_args,
                    env={"VLLM_CPU_KVCACHE_SPACE": "2"}) as server:
        command = [str(Path(sys.executable).with_name("vllm")), "bench", "serve",
                   "--backend", "openai", "--base-url", server.url,
                   "--model", str(model_dir), "--dataset-name", "custom",
                   "--dataset-path", str(prompts), "--custom-output-len",
                   str(args.output_tokens), "--num-prompts", str(args.num_prompts),
                   "--max-concurrency", str(args.max_concurrency), "--temperature", "0",
                   "--ignore-eos", "--save-result", "--result-dir", str(RESULTS),
                   "--result-filename", f"{args.name}.json"]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"vllm bench serve failed:\n{run.stderr[-3000:]}")
        report = run.stdout
    summary = report[report.find("============ Serving Benchmark Result"):]
    (RESULTS / f"{args.name}.txt").write_text(
        f"$ python scripts/bench_serve.py {' '.join(sys.argv[1:])}\n{summary}")
    print(summary)


if __name__ == "__main__":
    main()
