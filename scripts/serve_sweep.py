"""Speculation under serving load, measured the ecosystem's way.

Every setting gets its own real `vllm serve`, and vLLM's own harness,
`vllm bench serve --max-concurrency C`, runs the workload at every
concurrency and temperature against it. By default (paired) a fresh plain
vLLM server, started just before it, is up beside it, idle while it runs, and
each shape runs plain, setting, setting, plain, on two sets of requests
(ABBA): the machine's drift, which moves a server's speed by tens of per
cent over minutes, is shared by the runs compared, within a minute or two,
and a fresh server's first minutes are compared with a fresh plain server's.
`--bracketed` runs one server at a time instead, plain's before the first
start and after each one (plain, A, B, plain, A, B, plain, ...). Each run
asks its own requests, none asked before on that server (a cross-request
cache of past answers would otherwise draft them exactly), the same ones on
every server: mixed questions after a wave of C warm-up requests, or the
follow-ups of multi-turn and edit sessions after the server answered what
they follow. Per (setting, concurrency, temperature) it keeps output
tokens/s, median and p99 TPOT and TTFT, vLLM's acceptance counters and the
share of request-rounds that drafted (`vllm:selfspec_rounds_total`, ours
only), over the measured requests; a start's ratio is over its paired plain
server's same runs (bracketed: the geometric mean of the two plain servers
around its start), and each figure over starts is their geometric mean with
the spread.

    python scripts/serve_sweep.py                                   # SmolLM2, the default grid
    python scripts/serve_sweep.py --settings plain,ngram,recommended --concurrency 1,4,16 \
        --temperatures 0,0.8 --starts 3 --name sweep-smollm2
    python scripts/serve_sweep.py --workload multiturn --settings plain,suffix,recommended_suffix \
        --concurrency 1,4 --name sweep-smollm2-multiturn

Writes runs/<name>.json, runs/<name>.md (the table) and
runs/<name>.png (throughput and TPOT against concurrency).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests
from bench.plots import plot_serving
from bench.presets import settings_for
from bench.provenance import provenance
from bench.report import serving_table
from serving import Server, vllm_serve
from tqdm import tqdm
from transformers import AutoTokenizer

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import ROOT, fast_dtype
from vllm_selfspec.assets import RESULTS_DIR as RESULTS


# Each workload's items, in the order the sweep's runs take them.
WORKLOADS = {
    # one question each, HumanEval and MT-bench first turns taking turns
    "mixed": prompt_sets.mixed,
    # (first turn, second turn): the second is measured, asked after the
    # server's own answer to the first
    "multiturn": prompt_sets.mtbench_conversations,
    # (request, the request again with a change): the second is measured, a
    # new request after the server answered the first
    "edit": prompt_sets.humaneval_edits,
}


@dataclass(frozen=True)
class Run:
    """One measured `vllm bench serve` run on a server, and its own items."""
    temperature: float
    concurrency: int
    items: list
    warmups: list[str]  # mixed only: asked first, not measured


def plan_runs(args, copies: int = 1) -> tuple[list[Run], bool]:
    """Every server's runs, greedy first, each shape `copies` times in a row,
    each run with items no other run on the server asks (an answer to the
    same request in a cross-request cache, such as suffix decoding's tree of
    past responses, would be an exact draft), and mixed's warm-up waves from
    GSM-style problems, asked nowhere else. The second value says whether the
    workload ran out of items and runs share some."""
    shape = [(t, c, max(args.min_prompts, c * args.prompts_per_client))
             for t in args.temperatures for c in args.concurrency for _ in range(copies)]
    total = sum(size for *_, size in shape)
    pool = WORKLOADS[args.workload](total)
    runs, taken = [], 0
    for index, (temperature, concurrency, size) in enumerate(shape):
        items = [pool[(taken + i) % len(pool)] for i in range(size)]
        taken += size
        warmups = (prompt_sets.gsm_style(concurrency * args.warmup_waves, seed=100 + index)
                   if args.workload == "mixed" and args.warmup_waves else [])
        runs.append(Run(temperature, concurrency, items, warmups))
    return runs, len(pool) < total


def spec_counters(server: Server) -> dict[str, float]:
    """vLLM's speculative counters and ours by source, summed since start."""
    scrape = requests.get(f"{server.url}/metrics", timeout=30).text
    drafted, accepted, drafts = server.spec_counters(scrape)
    rounds = {source: server.metric("vllm:selfspec_rounds_total", scrape, source=source)
              for source in ("self", "lookup", "none")}
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts,
            **{f"rounds_{source}": value for source, value in rounds.items()}}


def bench(server: Server, model_dir: Path, prompts: list[str], result: Path, args,
          run: Run, *, chat: bool = True, measured: bool = True) -> dict:
    """`vllm bench serve` over `prompts` in their order at the run's
    concurrency and temperature; its saved result. A prompt is one user
    message for the chat endpoint, or (`chat` False) a conversation already in
    the model's chat template for the completions endpoint. No warm-up or
    ready-check request: vLLM's repeat the first prompt. A measured run ignores
    EOS (every request `--output-tokens` long); the others keep the answers."""
    dataset = result.with_suffix(".jsonl")
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    backend, endpoint = (("openai-chat", "/v1/chat/completions") if chat
                         else ("openai", "/v1/completions"))
    command = [str(Path(sys.executable).with_name("vllm")), "bench", "serve",
               "--backend", backend, "--endpoint", endpoint,
               "--base-url", server.url, "--model", str(model_dir),
               "--dataset-name", "custom", "--dataset-path", str(dataset),
               "--skip-chat-template", "--disable-shuffle",
               "--custom-output-len", str(args.output_tokens),
               "--num-prompts", str(len(prompts)), "--max-concurrency", str(run.concurrency),
               "--num-warmups", "0", "--ready-check-timeout-sec", "0",
               "--temperature", str(run.temperature), "--seed", "0",
               "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name,
               *(["--ignore-eos"] if measured else ["--save-detailed"])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def measured_prompts(server: Server, model_dir: Path, tokenizer, run: Run, stem: Path,
                     args) -> tuple[list[str], bool]:
    """Ask what comes before the run's measured requests (mixed's warm-up
    waves; the first turns or first requests of the others, answered by this
    server) and return the measured prompts and whether they go to the chat
    endpoint."""
    if args.workload == "mixed":
        if run.warmups:
            bench(server, model_dir, run.warmups, stem.with_name(stem.name + "-warmup.json"),
                  args, run, measured=False)
        return run.items, True
    firsts = [first for first, _ in run.items]
    answers = bench(server, model_dir, firsts, stem.with_name(stem.name + "-history.json"),
                    args, run, measured=False)["generated_texts"]
    if args.workload == "edit":
        return [second for _, second in run.items], True
    conversations = [[{"role": "user", "content": first},
                      {"role": "assistant", "content": answer},
                      {"role": "user", "content": second}]
                     for (first, second), answer in zip(run.items, answers)]
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in conversations], False


@contextlib.contextmanager
def serve(spec: dict | None, model_dir: Path, args, log_name: str) -> Iterator[Server]:
    server_args = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                   "--seed", "0", "--max-num-seqs", str(max(args.concurrency))]
    with vllm_serve(model_dir, spec, RESULTS / "logs" / f"{args.name}-{log_name}.log",
                    server_args, env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}) as server:
        yield server


def measure(server: Server, name: str, model_dir: Path, tokenizer, run: Run, args,
            stem: str, **labels) -> dict:
    """One run against `name`'s server: its row, with `labels` (start, pair)."""
    stem = RESULTS / "logs" / f"{args.name}-{stem}-c{run.concurrency}-t{run.temperature}"
    prompts, chat = measured_prompts(server, model_dir, tokenizer, run, stem, args)
    before = spec_counters(server)
    out = bench(server, model_dir, prompts, stem.with_name(stem.name + ".json"), args, run,
                chat=chat)
    after = spec_counters(server)
    counts = {key: after[key] - before[key] for key in after}
    rounds = sum(counts[f"rounds_{s}"] for s in ("self", "lookup", "none"))
    return {
        "setting": name, **labels, "workload": args.workload,
        "concurrency": run.concurrency, "temperature": run.temperature,
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
    }


def bracketed(args, others: list[str], known: dict, model_dir: Path, tokenizer,
              runs: list[Run], progress: tqdm, save) -> list[dict]:
    """One server at a time: plain, A, B, plain, A, B, plain, ...; plain's
    server s is the one just before start s's others."""
    order = [("plain", 0)]
    for start in range(args.starts):
        order += [(name, start) for name in others] + [("plain", start + 1)]
    rows: list[dict] = []
    for name, start in order:
        progress.set_postfix_str(f"start {start + 1}: {name}")
        log = f"{name}-{start}"
        with serve(known[name], model_dir, args, log) as server:
            for index, run in enumerate(runs):
                rows.append(measure(server, name, model_dir, tokenizer, run, args,
                                    f"{log}-r{index}", start=start))
                progress.update()
        save(rows)
    return rows


def paired(args, others: list[str], known: dict, model_dir: Path, tokenizer,
           runs: list[Run], progress: tqdm, save) -> list[dict]:
    """Per start and setting, a fresh plain server and the setting's, up
    together; each shape's two runs (a, b) go plain a, setting a, setting b,
    plain b."""
    rows: list[dict] = []
    for start in range(args.starts):
        for name in others:
            progress.set_postfix_str(f"start {start + 1}: {name} beside plain")
            pair = f"{name}/{start}"
            logs = {"plain": f"plain-beside-{name}-{start}", name: f"{name}-{start}"}
            with (serve(None, model_dir, args, logs["plain"]) as plain,
                  serve(known[name], model_dir, args, logs[name]) as ours):
                for index in range(0, len(runs), 2):
                    for server, setting, run_index in ((plain, "plain", index),
                                                       (ours, name, index),
                                                       (ours, name, index + 1),
                                                       (plain, "plain", index + 1)):
                        rows.append(measure(server, setting, model_dir, tokenizer,
                                            runs[run_index], args,
                                            f"{logs[setting]}-r{run_index}",
                                            start=start, pair=pair))
                        progress.update()
            save(rows)
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
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS),
                        help="mixed: HumanEval and MT-bench questions; multiturn: MT-bench's "
                             "second turns after the server's answers to the first; edit: "
                             "HumanEval prompts asked again with one of their tests required, "
                             "after the server answered them")
    parser.add_argument("--starts", type=int, default=3, help="engine starts per setting")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-client", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--warmup-waves", type=int, default=1,
                        help="mixed: before each measured run, this many waves of "
                             "--max-concurrency requests that are not measured: a server that "
                             "has run for a while, as in production, not its first requests "
                             "(the other workloads' first turns are their warm-up)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--dtype", default=fast_dtype())
    parser.add_argument("--bracketed", action="store_true",
                        help="one server at a time, plain's around each start, instead of a "
                             "plain server up beside each setting's with ABBA runs")
    parser.add_argument("--name", default="serve-sweep")
    args = parser.parse_args()
    known = settings_for(args.model)
    unknown = [s for s in args.settings if s not in known]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; known: {sorted(known)}")
    args.settings = list(dict.fromkeys(args.settings))  # a setting named twice runs once
    if "plain" not in args.settings:
        args.settings.insert(0, "plain")
    others = [s for s in args.settings if s != "plain"]
    if not others and not args.bracketed:
        raise SystemExit("--settings: name a setting besides plain, or pass --bracketed to "
                         "measure plain's servers alone")
    model_dir = ROOT / "models" / args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runs, reused = plan_runs(args, copies=1 if args.bracketed else 2)
    if reused:
        print(f"--workload {args.workload} has fewer items than the runs ask for; runs on a "
              f"server share some, which a cache of past responses has seen")

    def save(rows: list[dict]) -> None:
        (RESULTS / f"{args.name}.json").write_text(json.dumps(
            {**provenance(), "argv": sys.argv, "dtype": args.dtype,
             "workload": args.workload, "items_shared_between_runs": reused,
             "order": "bracketed" if args.bracketed else "paired", "rows": rows}, indent=1))

    servers = ((1 + args.starts * (len(others) + 1)) if args.bracketed
               else 2 * args.starts * len(others))
    with tqdm(total=servers * len(runs), desc="bench runs") as progress:
        order = bracketed if args.bracketed else paired
        rows = order(args, others, known, model_dir, tokenizer, runs, progress, save)
    report = serving_table(rows, args)
    (RESULTS / f"{args.name}.md").write_text(report)
    plot_serving(rows, args, RESULTS / f"{args.name}.png")
    print(report)
    print(f"{RESULTS / args.name}.json, .md, .png")


if __name__ == "__main__":
    main()
