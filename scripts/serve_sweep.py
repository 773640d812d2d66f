"""Speculation under serving load, measured the ecosystem's way.

For each engine start, every setting gets its own real `vllm serve` in turn,
with a plain vLLM server before the first start and after each one
(plain, A, B, plain, A, B, plain, ...: every start bracketed by plain servers
on the same drifting machine), and vLLM's own harness, `vllm bench serve
--max-concurrency C`, runs the same chat prompts at every concurrency and
temperature against it, each run after a wave of C warm-up requests
(`--num-warmups`; the counters below include them). Per (setting,
concurrency, temperature) it keeps output tokens/s, median and p99 TPOT and
TTFT, vLLM's acceptance counters and the share of request-rounds that drafted
(`vllm:selfspec_rounds_total`, ours only); ratios are over the geometric mean
of the two plain servers around its start, and each figure over starts is
their geometric mean with the spread.

    python scripts/serve_sweep.py                                   # SmolLM2, the default grid
    python scripts/serve_sweep.py --settings plain,ngram,recommended --concurrency 1,4,16 \
        --temperatures 0,0.8 --starts 3 --name sweep-smollm2

Writes runs/<name>.json, runs/<name>.md (the table) and
runs/<name>.png (throughput and TPOT against concurrency).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import requests
from bench.plots import plot_serving
from bench.presets import (
    NGRAM,
    NGRAM_DYNAMIC,
    SUFFIX,
    recommended_config,
    recommended_suffix_config,
)
from bench.report import serving_table
from serving import Server, vllm_serve
from tqdm import tqdm

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import ROOT, cpu_flags, fast_dtype
from vllm_selfspec.assets import RESULTS_DIR as RESULTS


def settings_for(model: str) -> dict[str, dict | None]:
    """Every setting the sweep knows, by name; each method at its defaults
    (the shipped vocabulary and heads are found by the model's weights)."""
    return {
        "plain": None,
        "ngram": NGRAM,
        "ngram_dynamic": NGRAM_DYNAMIC,
        "suffix": SUFFIX,
        "recommended": recommended_config(model),
        "recommended_suffix": recommended_suffix_config(model),
        "draft_verify": {"method": "draft_verify"},
        "swift": {"method": "swift"},
        "del": {"method": "del"},
        "adadecode": {"method": "adadecode"},
    }


def write_prompts(path: Path, count: int, output_tokens: int) -> Path:
    """Half HumanEval, half MT-bench, as vLLM's `custom` dataset: each question
    is one user message, which the server's chat endpoint templates (hence
    `--skip-chat-template` for the harness, which would template it a second
    time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": q, "output_tokens": output_tokens}) + "\n"
                            for q in prompt_sets.code_then_chat(count)))
    return path


def spec_counters(server: Server) -> dict[str, float]:
    """vLLM's speculative counters and ours by source, summed since start."""
    scrape = requests.get(f"{server.url}/metrics", timeout=30).text
    drafted, accepted, drafts = server.spec_counters(scrape)
    rounds = {source: server.metric("vllm:selfspec_rounds_total", scrape, source=source)
              for source in ("self", "lookup", "none")}
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts,
            **{f"rounds_{source}": value for source, value in rounds.items()}}


def bench(server: Server, model_dir: Path, prompts: Path, args, concurrency: int,
          temperature: float, result: Path) -> dict:
    """One `vllm bench serve` run; its saved result."""
    num_prompts = max(args.min_prompts, concurrency * args.prompts_per_client)
    command = [str(Path(sys.executable).with_name("vllm")), "bench", "serve",
               "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
               "--base-url", server.url, "--model", str(model_dir),
               "--dataset-name", "custom", "--dataset-path", str(prompts),
               "--skip-chat-template",
               "--custom-output-len", str(args.output_tokens),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
               "--num-warmups", str(concurrency * args.warmup_waves),
               "--temperature", str(temperature), "--seed", "0", "--ignore-eos",
               "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{run.stderr[-3000:]}")
    return json.loads(result.read_text())


def measure(name: str, spec: dict | None, model_dir: Path, prompts: Path, args,
            start: int, progress: tqdm) -> list[dict]:
    """One server of `name`: every concurrency and temperature against it."""
    logs = RESULTS / "logs"
    server_args = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                   "--seed", "0", "--max-num-seqs", str(max(args.concurrency))]
    rows = []
    with vllm_serve(model_dir, spec, logs / f"{args.name}-{name}-{start}.log", server_args,
                    env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}) as server:
        for temperature in args.temperatures:
            for concurrency in args.concurrency:
                before = spec_counters(server)
                out = bench(server, model_dir, prompts, args, concurrency, temperature,
                            logs / f"{args.name}-{name}-{start}-c{concurrency}-t{temperature}.json")
                after = spec_counters(server)
                counts = {key: after[key] - before[key] for key in after}
                rounds = sum(counts[f"rounds_{s}"] for s in ("self", "lookup", "none"))
                rows.append({
                    "setting": name, "start": start, "concurrency": concurrency,
                    "temperature": temperature,
                    "output_throughput": out["output_throughput"],
                    "median_tpot_ms": out["median_tpot_ms"], "p99_tpot_ms": out["p99_tpot_ms"],
                    "median_ttft_ms": out["median_ttft_ms"], "p99_ttft_ms": out["p99_ttft_ms"],
                    "acceptance": (counts["accepted_tokens"] / counts["draft_tokens"]
                                   if counts["draft_tokens"] else None),
                    "mean_accepted_length": (1 + counts["accepted_tokens"] / counts["drafts"]
                                             if counts["drafts"] else None),
                    "drafted_share": ((counts["rounds_self"] + counts["rounds_lookup"]) / rounds
                                      if rounds else None),
                    "counts": counts, "finished_at": time.time(),
                })
                progress.update()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="name under models/")
    parser.add_argument("--settings", default="plain,ngram,recommended",
                        type=lambda s: s.split(","),
                        help="comma-separated, from: " + ", ".join(settings_for("smollm2-135m")))
    parser.add_argument("--concurrency", default="1,2,4,8,16,32",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--temperatures", default="0,0.8",
                        type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--starts", type=int, default=3, help="engine starts per setting")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-client", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--warmup-waves", type=int, default=1,
                        help="before each measured run, this many waves of --max-concurrency "
                             "requests that are not measured (vLLM's --num-warmups): a server "
                             "that has run for a while, as in production, not its first requests")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--dtype", default=fast_dtype())
    parser.add_argument("--name", default="serve-sweep")
    args = parser.parse_args()
    known = settings_for(args.model)
    unknown = [s for s in args.settings if s not in known]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; known: {sorted(known)}")
    if "plain" not in args.settings:
        args.settings.insert(0, "plain")
    model_dir = ROOT / "models" / args.model
    prompts = write_prompts(RESULTS / "logs" / f"{args.name}-prompts.jsonl",
                            max(args.min_prompts, max(args.concurrency) * args.prompts_per_client),
                            args.output_tokens)
    others = [s for s in args.settings if s != "plain"]
    rows: list[dict] = []
    per_server = len(args.concurrency) * len(args.temperatures)
    # (setting, start); plain's server s is the one just before start s's others.
    if others:
        order = [("plain", 0)]
        for start in range(args.starts):
            order += [(name, start) for name in others] + [("plain", start + 1)]
    else:
        order = [("plain", start) for start in range(args.starts)]
    with tqdm(total=len(order) * per_server, desc="bench runs") as progress:
        for name, start in order:
            progress.set_postfix_str(f"start {start + 1}: {name}")
            rows += measure(name, known[name], model_dir, prompts, args, start, progress)
            (RESULTS / f"{args.name}.json").write_text(json.dumps(
                {"argv": sys.argv, "cpu_flags": cpu_flags(), "dtype": args.dtype,
                 "rows": rows}, indent=1))
    report = serving_table(rows, args)
    (RESULTS / f"{args.name}.md").write_text(report)
    plot_serving(rows, args, RESULTS / f"{args.name}.png")
    print(report)
    print(f"{RESULTS / args.name}.json, .md, .png")


if __name__ == "__main__":
    main()
