"""The benchmark's PNGs: speed-ups and acceptance, per prompt set, AdaDecode's
threshold sweep, DEL's trace and SWIFT's search."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.runner import Run


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    speedups = [r["speedup"] for r in rows]
    errors = [[r["speedup"] - r["speedup_spread"][0] for r in rows],
              [r["speedup_spread"][1] - r["speedup"] for r in rows]]
    left.bar(names, speedups, yerr=errors, color="tab:blue", capsize=4)
    ideal = [(i, r["ideal_speedup_S*"]) for i, r in enumerate(rows)
             if "ideal_speedup_S*" in r]
    if ideal:
        left.scatter(*zip(*ideal), color="tab:red", zorder=3, label="ideal S*")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("decode speed-up vs plain vLLM (batch 1)")
    left.tick_params(axis="x", rotation=30)
    if ideal:
        left.legend()
    accept = [r["acceptance"] or 0 for r in rows]
    right.bar(names, accept, color="tab:green")
    right.set_ylabel("draft acceptance rate")
    right.set_ylim(0, 1.05)
    right.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_prompt_sets(rows: list[dict], path: Path, title: str) -> None:
    """Each method's speed-up over plain vLLM, one group of bars per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(rows[0]["by_prompt_set"])
    methods = rows[1:]
    width = 0.8 / max(len(methods), 1)
    fig, axis = plt.subplots(figsize=(12, 4.5))
    for index, row in enumerate(methods):
        axis.bar([position + index * width for position in range(len(sets))],
                 [row["by_prompt_set"][name]["speedup"] for name in sets], width,
                 label=row["method"])
    axis.set_xticks([position + width * (len(methods) - 1) / 2
                     for position in range(len(sets))], sets)
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.axhline(0.97, color="tab:red", lw=0.8, ls="--", label="0.97x plain")
    axis.set_ylabel("decode speed-up vs plain vLLM (batch 1)")
    axis.legend(fontsize=7, ncol=2)
    axis.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_sweep(rows: list[dict], path: Path, model: str) -> None:
    """Speed-up, early-prediction rate and rejection rate against the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = [float(r["method"].split("@")[1]) for r in rows]
    fig, axis = plt.subplots(figsize=(6.5, 4))
    axis.plot(thresholds, [r["speedup"] for r in rows], "o-", label="speed-up vs plain")
    axis.plot(thresholds, [r["accepted_token_share"] or 0 for r in rows], "s-",
              label="early-prediction rate (kept early tokens / tokens)")
    axis.plot(thresholds, [r["rejection_rate"] or 0 for r in rows], "^-",
              label="rejection rate (rejected / early tokens)")
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.set_xlabel("AdaDecode threshold")
    axis.set_title(f"{model}: AdaDecode threshold sweep (batch 1)")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_del_trace(rounds: list[dict], path: Path, model: str) -> None:
    """Exit layer, threshold tau and estimated acceptance per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(rounds))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.step(steps, [r["exit_layer"] if r["max_drafts"] else 0 for r in rounds],
             where="post", color="tab:purple")
    top.set_ylabel("exit layer E\n(0: no draft)")
    bottom.plot(steps, [r["threshold"] for r in rounds], label="threshold tau_E")
    bottom.plot(steps, [r["acceptance"] for r in rounds], label="estimated alpha_E")
    bottom.set_xlabel("speculative round")
    bottom.set_ylim(0, 1)
    bottom.legend(fontsize=8)
    top.set_title(f"{model}: DEL's choices over one request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_swift_search(run: Run, plain: Run, path: Path, model: str) -> None:
    """The paper's Figure 6: matchness of each scored candidate and of the
    incumbent over the search, and each request's speed-up over plain vLLM on
    the same prompt and repeat, against the search iterations done by then."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = run.step_costs["search"]["tasks"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    for task, search in tasks.items():
        history = search["history"]
        top.scatter([h["iteration"] for h in history], [h["score"] for h in history],
                    s=4, alpha=0.3, label=f"{task}: candidate")
        top.step([h["iteration"] for h in history], [h["incumbent_score"] for h in history],
                 where="post", label=f"{task}: incumbent")
        windows = search["windows"]
        top.plot([w["iteration"] for w in windows], [w["uniform"] for w in windows], "x",
                 color="black", label=f"{task}: uniform set (same window)")
    top.set_xlabel("candidates scored")
    top.set_ylabel("matchness")
    top.set_ylim(0, 1.02)
    top.legend(fontsize=7)
    speedups = [ours / base for ours, base in
                zip(run.request_tokens_per_s, plain.request_tokens_per_s)]
    bottom.plot(range(1, len(speedups) + 1), speedups, "o-", label="speed-up vs plain")
    searching = [i + 1 for i, n in enumerate(run.search_iterations)
                 if i == 0 or n > run.search_iterations[i - 1]]
    bottom.axvspan(0.5, max(searching) + 0.5, color="tab:orange", alpha=0.15,
                   label="search running")
    bottom.axhline(1.0, color="grey", lw=0.8)
    bottom.set_xlabel("request (one at a time, every repeat)")
    bottom.set_ylabel("decode speed-up")
    bottom.legend(fontsize=7)
    top.set_title(f"{model}: SWIFT's on-line search while serving")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_serving(rows: list[dict], args, path: Path) -> None:
    """Output tokens/s and median TPOT against requests in flight, per setting
    and temperature (geometric mean over starts)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(args.temperatures), 2, squeeze=False,
                                figsize=(11, 4 * len(args.temperatures)))
    for line, temperature in enumerate(args.temperatures):
        for column, (metric, label) in enumerate((("output_throughput", "output tokens/s"),
                                                  ("median_tpot_ms", "median TPOT (ms)"))):
            axis = axes[line][column]
            for setting in args.settings:
                points = [(c, statistics.geometric_mean([r[metric] for r in rows if r["setting"] == setting
                                       and r["concurrency"] == c
                                       and r["temperature"] == temperature]))
                          for c in args.concurrency
                          if any(r["setting"] == setting and r["concurrency"] == c
                                 and r["temperature"] == temperature for r in rows)]
                if points:
                    axis.plot(*zip(*points), marker="o", label=setting)
            axis.set_xscale("log", base=2)
            axis.set_xlabel("requests in flight (--max-concurrency)")
            axis.set_ylabel(label)
            axis.set_title(f"{args.model}, temperature {temperature}")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
