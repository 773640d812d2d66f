"""SWIFT adapting while it serves (the paper's Figures 6 and 7).

A stream of HumanEval, then MT-bench, then GSM-style requests, one at a time,
each tagged with its task (`extra_args={"selfspec_task": ...}`), through plain
vLLM and through `swift` on the same prompts. Per request: decode tokens/s
against plain vLLM's for the same request (the instantaneous speed-up), the
acceptance, and the task's best matchness so far. The share of decode time
spent optimising is reported. Results: runs/<name>.json and .png.

    python scripts/lab/swift_stream.py                      # 12 requests per task
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench package

from bench.runner import accepted_tokens, decode_time, shutdown, start
from tqdm import tqdm

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.assets import ROOT, fast_dtype


def run_stream(llm, stream: list[tuple[str, str]], args, searching: bool) -> list[dict]:
    from vllm import SamplingParams

    rows = []
    llm.generate([stream[0][1]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for task, prompt in tqdm(stream, desc="swift" if searching else "plain"):
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                extra_args={"selfspec_task": task})
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        tokens, seconds = decode_time(output)
        row = {"task": task, "tokens_per_s": tokens / seconds, "decode_seconds": seconds,
               "text": output.outputs[0].text}
        spec = output.outputs[0].spec_decode_metrics
        if spec is not None and spec.num_draft_tokens:
            row["acceptance"] = accepted_tokens(spec) / spec.num_draft_tokens
        if searching:
            (report,) = llm.collective_rpc("selfspec_search")
            search = report["tasks"].get(task, {})
            row.update(iterations=search.get("iterations", 0), done=search.get("done"),
                       matchness=search.get("incumbent_score"),
                       optimise_seconds=report["optimise_seconds"])
        rows.append(row)
    return rows


def plot(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"code": "tab:blue", "chat": "tab:orange", "math": "tab:green"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for task, colour in colours.items():
        points = [(i, r) for i, r in enumerate(rows) if r["task"] == task]
        if not points:
            continue
        xs = [i for i, _ in points]
        top.plot(xs, [r["speedup"] for _, r in points], "o-", color=colour, label=task)
        bottom.plot(xs, [r["matchness"] or 0 for _, r in points], "s-", color=colour,
                    label=f"{task}: best matchness")
        bottom.plot(xs, [r.get("acceptance") or 0 for _, r in points], "x:", color=colour,
                    label=f"{task}: acceptance")
    top.axhline(1.0, color="grey", lw=0.8)
    top.set_ylabel("speed-up vs plain\n(same request)")
    top.legend(fontsize=8)
    bottom.set_ylabel("matchness / acceptance")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("request in the stream")
    bottom.legend(fontsize=7, ncol=3)
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--per-task", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=fast_dtype(),
                        help="(default: bfloat16 where the hardware has it, else float32)")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--config", default="{}", help="extra swift settings, JSON")
    parser.add_argument("--name", help="results file stem")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer

    model_dir = ROOT / "models" / args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n = args.per_task
    stream = [(task, prompt) for task, questions in (
        ("code", prompt_sets.humaneval(n)), ("chat", prompt_sets.mtbench(n)),
        ("math", prompt_sets.gsm_style(n)))
        for prompt in prompt_sets.as_chat(tokenizer, questions)]

    llm = start(model_dir, None, args)
    plain = run_stream(llm, stream, args, searching=False)
    shutdown(llm)
    spec = {"method": "swift", **json.loads(args.config)}
    llm = start(model_dir, spec, args)
    ours = run_stream(llm, stream, args, searching=True)
    (final,) = llm.collective_rpc("selfspec_search")
    shutdown(llm)

    for row, reference in zip(ours, plain):
        row["speedup"] = row["tokens_per_s"] / reference["tokens_per_s"]
        row["identical_to_plain"] = row.pop("text") == reference["text"]
    decode_seconds = sum(r["decode_seconds"] for r in ours)
    summary = {
        "requests": len(ours),
        "identical_to_plain": sum(r["identical_to_plain"] for r in ours),
        "speedup_by_task": {task: statistics.mean(r["speedup"] for r in ours
                                                  if r["task"] == task)
                            for task, _ in stream[::n]},
        "optimise_share_of_decode": final["optimise_seconds"] / decode_seconds,
        "searches": {task: {k: v for k, v in search.items() if k != "history"}
                     for task, search in final["tasks"].items()},
    }
    name = args.name or f"{args.model}-{args.dtype}-swift-stream"
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python scripts/lab/swift_stream.py " + " ".join(os.sys.argv[1:])
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"command": command.strip(), "config": spec, "summary": summary,
         "requests": ours, "plain_tokens_per_s": [r["tokens_per_s"] for r in plain]},
        indent=2))
    plot(ours, RESULTS / f"{name}.png",
         f"{args.model}: SWIFT over a code -> chat -> math stream (batch 1)")
    print(json.dumps({k: v for k, v in summary.items() if k != "searches"}, indent=2))
    for task, search in summary["searches"].items():
        print(task, {k: search[k] for k in ("iterations", "done", "incumbent_score")})
    print(f"saved {RESULTS / name}.json and .png")


if __name__ == "__main__":
    main()
