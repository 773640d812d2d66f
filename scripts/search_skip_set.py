"""Draft & Verify's offline skip-set search: Bayesian optimisation (Gaussian
process, the `bayesian-optimization` package as in the reference code) of the
measured time per generated token on a few held-out dev prompts.

Each of the 2L dimensions (attention and MLP sub-block of every layer) is in
[0, 1] and > 0.5 means "skip". One eager engine serves the whole search: each
candidate is swapped into the running drafter (`set_skip_set`), then the dev
prompts are decoded one at a time and timed from vLLM's per-request
timestamps. The search's history, plot and a config file holding the best set
go to runs/<name>.{json,png} and runs/<name>-config.json, for
`{"method": "draft_verify", "config_file": "runs/<name>-config.json"}`;
`--install` writes the set into the shipped vllm_selfspec/configs/<model>.json.

    python scripts/search_skip_set.py --model smollm2-135m --iterations 80
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tqdm import tqdm

from bench.runner import accepted_tokens, decode_time, shutdown
from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import CONFIGS_DIR, RESULTS_DIR, ROOT, fast_dtype


def decode_seconds_per_token(llm, prompts, max_tokens: int) -> tuple[float, float | None]:
    """Seconds per decoded token over the prompts, and the draft acceptance."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens, seconds, drafted, accepted = 0, 0.0, 0, 0
    for prompt in prompts:
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        decoded, took = decode_time(output)
        tokens, seconds = tokens + decoded, seconds + took
        spec = output.outputs[0].spec_decode_metrics
        if spec is not None:
            drafted += spec.num_draft_tokens
            accepted += accepted_tokens(spec)
    return seconds / tokens, (accepted / drafted if drafted else None)


def to_skip_sets(point: dict[str, float], num_layers: int) -> tuple[list[int], list[int]]:
    attn = [i for i in range(num_layers) if point[f"attn_{i:02d}"] > 0.5]
    mlp = [i for i in range(num_layers) if point[f"mlp_{i:02d}"] > 0.5]
    return attn, mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--iterations", type=int, default=80, help="BO steps")
    parser.add_argument("--init-points", type=int, default=12, help="random steps first")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-speculative-tokens", type=int, default=12,
                        help="K, most drafts per round (Draft & Verify's default 12)")
    parser.add_argument("--dtype", default=fast_dtype(),
                        help="(default: bfloat16 where the hardware has it, else float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", help="runs/<name>.* (default: search-<model>)")
    parser.add_argument("--install", action="store_true",
                        help=f"also write the best set into the shipped {CONFIGS_DIR.name}/<model>.json")
    args = parser.parse_args()
    name = args.name or f"search-{args.model}"

    from bayes_opt import BayesianOptimization
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM

    from vllm_selfspec.diagnostics import WORKER_EXTENSION
    from vllm_selfspec.policy.skip_search import ucb_acquisition

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model_dir = ROOT / "models" / args.model
    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    # Held out from the benchmark's prompts (HumanEval[:4], MT-bench[:4]).
    questions = prompt_sets.humaneval(12)[10:12] + prompt_sets.mtbench(12)[10:12]
    dev_prompts = prompt_sets.as_chat(AutoTokenizer.from_pretrained(model_dir), questions)

    llm = LLM(model=str(model_dir), dtype=args.dtype, max_model_len=2048, seed=0,
              enforce_eager=True, disable_log_stats=False,
              per_request_spec_decode_metrics="summary",
              worker_extension_cls=WORKER_EXTENSION,
              speculative_config={"method": "draft_verify",
                                  "num_speculative_tokens": args.num_speculative_tokens})
    decode_seconds_per_token(llm, dev_prompts[:1], 8)  # warm-up

    history: list[dict] = []

    def evaluate(attn: list[int], mlp: list[int]) -> float:
        if len(attn) == len(mlp) == num_layers:
            return -1.0  # everything skipped: not a valid draft
        llm.collective_rpc("selfspec_set_skip_set", args=(attn, mlp))
        seconds, acceptance = decode_seconds_per_token(llm, dev_prompts, args.max_tokens)
        history.append({"attn_skip": attn, "mlp_skip": mlp, "ms_per_token": seconds * 1e3,
                        "acceptance": acceptance})
        return -seconds * 1e3

    full_depth_ms = -evaluate([], [])
    bounds = {f"{kind}_{i:02d}": (0.0, 1.0) for kind in ("attn", "mlp")
              for i in range(num_layers)}
    optimizer = BayesianOptimization(f=None, pbounds=bounds, random_state=args.seed,
                                     acquisition_function=ucb_acquisition(2.5, args.seed),
                                     allow_duplicate_points=True)
    started = time.time()
    total = args.init_points + args.iterations
    with tqdm(total=total, desc="skip-set search") as bar:
        for step in range(total):
            if step < args.init_points:  # random sets skipping ~15% of sub-blocks
                draws = optimizer._random_state.uniform(0.0, 0.5 / 0.85, len(bounds))
                point = {k: float(v) for k, v in zip(bounds, draws)}
            else:
                point = optimizer.suggest()
            target = evaluate(*to_skip_sets(point, num_layers))
            optimizer.register(params=point, target=target)
            best = max(history, key=lambda h: -h["ms_per_token"])
            bar.set_postfix(best_ms=f"{best['ms_per_token']:.1f}",
                            full_ms=f"{full_depth_ms:.1f}")
            bar.update()
    shutdown(llm)

    best = min(history, key=lambda h: h["ms_per_token"])
    shipped = CONFIGS_DIR / f"{args.model}.json"
    config = json.loads(shipped.read_text()) if shipped.exists() else {
        "model": f"models/{args.model} (scripts/build_model.py {args.model})",
        "num_hidden_layers": num_layers, "methods": {}}
    config["methods"].setdefault("draft_verify", {}).update(
        attn_skip=best["attn_skip"], mlp_skip=best["mlp_skip"],
        num_speculative_tokens=args.num_speculative_tokens)
    config["how_made"] = "draft_verify: scripts/search_skip_set.py (see searches)"
    config.setdefault("searches", {})["draft_verify"] = {
        "command": f"python scripts/search_skip_set.py --model {args.model} "
                   f"--iterations {args.iterations} --init-points {args.init_points} "
                   f"--max-tokens {args.max_tokens} --dtype {args.dtype} "
                   f"--num-speculative-tokens {args.num_speculative_tokens}",
        "objective": "measured ms per token, eager engine, 4 held-out dev prompts, "
                     "adaptive exit threshold on",
        "best_ms_per_token": round(best["ms_per_token"], 2),
        "best_acceptance": best["acceptance"],
        "full_depth_ms_per_token": round(full_depth_ms, 2),
        "evaluations": len(history),
        "minutes": round((time.time() - started) / 60, 1),
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    config_paths = [RESULTS_DIR / f"{name}-config.json"] + ([shipped] if args.install else [])
    for path in config_paths:
        path.write_text(json.dumps(config, indent=2) + "\n")
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(history, indent=1))
    _plot(history, full_depth_ms, RESULTS_DIR / f"{name}.png")
    print(f"best: {best['ms_per_token']:.1f} ms/token (full depth {full_depth_ms:.1f}), "
          f"acceptance {best['acceptance']}, attn_skip={best['attn_skip']} "
          f"mlp_skip={best['mlp_skip']} -> {', '.join(map(str, config_paths))}")


def _plot(history: list[dict], full_depth_ms: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [h["ms_per_token"] for h in history]
    best = [min(values[: i + 1]) for i in range(len(values))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(range(len(values)), values, s=10, label="candidate")
    ax.plot(best, color="tab:red", label="best so far")
    ax.axhline(full_depth_ms, color="grey", ls="--", label="full-depth draft")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("ms per token (eager engine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
