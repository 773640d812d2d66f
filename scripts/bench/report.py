"""What the runs say: one row per setting (speed-up and its spread, acceptance,
token sources, the cost model's c, F and S*), the table a user reads and its
one-sentence reading."""

from __future__ import annotations

import statistics
import sys
from collections import Counter

from bench.machine import MACHINE_TOLERANCE
from bench.runner import CONSOLE, Run
from vllm_selfspec.assets import cpu_flags
from vllm_selfspec.integration.token_sources import MECHANISM_SOURCE, SOURCES
from vllm_selfspec.policy.payoff import StepCosts, costs_for, fit_round_costs


def round_sources(request_sources: list[dict]) -> dict:
    """How the requests' rounds drafted (self-draft, lookup, none: declined),
    as shares of all their rounds, how many requests used each, and the share
    of the self-drafted tokens that the method's own mechanism made (skipped
    layers, an early exit) rather than the full-depth base, with the
    acceptance of each (our methods' per-request token_sources)."""
    rounds, tokens = Counter(), Counter()
    for sources in request_sources:
        rounds.update({s: sources.get(f"{s}_rounds", 0) for s in SOURCES})
        tokens.update({key: value for key, value in sources.items()
                       if key.endswith(("_drafted", "_accepted"))})
    total = sum(rounds.values())
    if not total:
        return {}
    mechanism = tokens[f"{MECHANISM_SOURCE}_drafted"]
    base = tokens["self_drafted"] - mechanism
    base_accepted = tokens["self_accepted"] - tokens[f"{MECHANISM_SOURCE}_accepted"]
    return {"round_sources": {s: round(n / total, 3) for s, n in rounds.items()},
            "requests_using": {s: sum(bool(r.get(f"{s}_rounds")) for r in request_sources)
                               for s in rounds},
            "self_drafts_by_mechanism": (round(mechanism / tokens["self_drafted"], 3)
                                         if tokens["self_drafted"] else None),
            "mechanism_acceptance": (round(tokens[f"{MECHANISM_SOURCE}_accepted"] / mechanism, 3)
                                     if mechanism else None),
            "base_acceptance": round(base_accepted / base, 3) if base else None}


def by_prompt_set(run: Run, plain: Run, labels: list[str]) -> dict[str, dict]:
    """Each prompt set's decode tokens/s over its requests (all repeats), the
    speed-up over plain on the same requests, and how its requests' rounds
    drafted."""
    def of_set(items: list, name: str) -> list:
        return [item for index, item in enumerate(items)
                if labels[index % len(labels)] == name]

    def speed(decoded: list[tuple[int, float]]) -> float:
        return sum(tokens for tokens, _ in decoded) / sum(seconds for _, seconds in decoded)

    sets = {}
    for name in dict.fromkeys(labels):
        tokens_per_s = speed(of_set(run.request_decode, name))
        sets[name] = {"tokens_per_s": round(tokens_per_s, 2),
                      "speedup": round(tokens_per_s / speed(of_set(plain.request_decode, name)), 3),
                      **round_sources(of_set(run.request_sources, name))}
    return sets


def summarize(runs: list[Run], num_layers: int, batch_size: int,
              labels: list[str] | None = None) -> list[dict]:
    """One row per run; with `labels` (each prompt's set) naming several sets,
    also each set's speed-up and round sources (`by_prompt_set`)."""
    plain = next(r for r in runs if r.name == "plain")
    base = statistics.mean(plain.tokens_per_s)
    rows = []
    for run in runs:
        speed = statistics.mean(run.tokens_per_s)
        # Spread over engine starts when there are several (each against
        # plain's same start; plain's own starts against their mean), else
        # over the repeats of the one start.
        if len(run.start_tokens_per_s) < 2:
            spread = [repeat / base for repeat in run.tokens_per_s]
        elif run is plain:
            spread = [start / base for start in run.start_tokens_per_s]
        else:
            spread = [ours / theirs for ours, theirs in
                      zip(run.start_tokens_per_s, plain.start_tokens_per_s)]
        row = {
            "method": run.name,
            "tokens_per_s": round(speed, 2),
            "tokens_per_s_runs": [round(x, 2) for x in run.tokens_per_s],
            "tokens_per_s_starts": [round(x, 2) for x in run.start_tokens_per_s],
            "speedup": round(speed / base, 3),
            "speedup_spread": [round(min(spread), 3), round(max(spread), 3)],
            "acceptance": _round(run.acceptance),
            "mean_accepted_length": _round(run.mean_accepted_length),
            "drafts_per_round": _round(run.drafts_per_round),
            "accepted_token_share": _round(run.accepted / run.decode_tokens
                                           if run.drafted else None),
            "rejection_rate": _round(1 - run.acceptance if run.drafted else None),
            "identical_to_plain": f"{sum(a == b for a, b in zip(run.texts, plain.texts))}"
                                  f"/{len(plain.texts)}",
            **round_sources(run.request_sources),
            "eTPL": round(run.tokens_per_loaded_layer(num_layers), 4),
            "startup_s": round(run.startup_s, 1),
        }
        if run.start_machine_speed:
            row.update(machine_rows(run, plain))
        if run.retakes:
            row["retakes"] = run.retakes
        if labels and len(set(labels)) > 1:
            row["by_prompt_set"] = by_prompt_set(run, plain, labels)
        if run.step_costs:
            forward_cost = run.step_costs["cost_ratio"]
            row["forward_cost_ratio"] = round(forward_cost, 3)
            row["sublayers_run"] = round(run.step_costs["fraction_of_sublayers_run"], 3)
            # A setting that never drafted (it declined every round) has no S*.
            if run.rounds:
                row["ideal_speedup_forwards"] = round(
                    run.mean_accepted_length / (1 + run.drafts_per_round * forward_cost), 3)
            costs = engine_round_costs(run, base, batch_size)
            if costs is not None and run.rounds:
                row["draft_step_cost_ratio"] = round(costs.per_draft, 3)
                row["round_overhead"] = round(costs.round_overhead, 3)
                ideal = run.mean_accepted_length / (
                    1 + costs.round_overhead + run.drafts_per_round * costs.per_draft)
                row["ideal_speedup_S*"] = round(ideal, 3)
                row["measured_over_S*"] = round(speed / base / ideal, 3)
            shared = run.step_costs["rounds"]["shared"]
            engine = costs_for({b: StepCosts(**c) for b, c in shared.items()},
                               batch_size) if shared else None
            if engine is not None and engine.lookup_overhead is not None:
                # What the engine's own lookup rounds say a looked-up token costs.
                row["lookup_token_cost"] = round(engine.per_verified, 3)
                row["lookup_round_overhead"] = round(engine.lookup_overhead, 3)
            row["draft_copy_MB"] = round(run.step_costs["draft_copy_bytes"] / 1e6, 1)
            row["draft_copy_share"] = round(run.step_costs["draft_copy_bytes"]
                                            / run.step_costs["model_bytes"], 3)
        if run.step_costs and "search" in run.step_costs:  # SWIFT's on-line search
            search = run.step_costs["search"]
            row["optimise_share_of_decode"] = round(  # one engine's search, its decoding
                search["optimise_seconds"] / run.first_start_decode_seconds, 3)
            row["search_candidates"] = sum(t["iterations"] for t in search["tasks"].values())
            row["search_futile_rounds"] = search["futile_rounds"]
        rows.append(row)
    return rows


def machine_rows(run: Run, plain: Run) -> dict:
    """The machine's speed during each of the run's starts and, but for plain,
    against its speed during plain's same start. Not divided out of the
    speed-up: how decoding slows with the probe's bandwidth is not known."""
    row = {"machine_GBps_starts": [round(x, 2) for x in run.start_machine_speed]}
    if run is not plain:
        row["machine_vs_plain_starts"] = [
            round(ours / theirs, 3)
            for ours, theirs in zip(run.start_machine_speed, plain.start_machine_speed)]
    return row


def engine_round_costs(run: Run, plain_tokens_per_s: float, batch_size: int
                       ) -> StepCosts | None:
    """c (per draft token, its verification share included) and a drafted
    round's fixed extra F, both in plain steps, from the rounds the engine
    timed at this batch size; the plain step from the plain run (batch_size
    tokens per step). The profiling-mode ratio stands in for c where every
    round drafted the same count."""
    rounds = run.step_costs["rounds"]["drafted"].get(batch_size, [])
    if not rounds:
        return None
    plain_step_s = batch_size / plain_tokens_per_s
    return fit_round_costs([steps for steps, _ in rounds],
                           [seconds / plain_step_s - 1 for _, seconds in rounds],
                           StepCosts(per_draft=run.step_costs["cost_ratio"]))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def print_table(rows: list[dict], args, num_prompts: int) -> None:
    """What a user reads: tokens/s, the speed-up over plain with its spread
    and over vLLM's ngram (when it ran), acceptance and whether outputs match
    plain's; with --diagnostics also the machine probe (and a warning per
    start the machine drifted in), the cost model's c, F and S*, and how
    rounds drafted."""
    print(f"\n{args.model} {args.dtype}: decode tokens/s at batch "
          f"{args.batch_size} ({num_prompts} prompts, {args.max_tokens} new tokens, "
          f"{args.repeats} repeats x {args.engine_starts} engine starts"
          f"{', interleaved' if args.interleave else ''}); CPU flags: "
          f"{' '.join(cpu_flags())}", file=CONSOLE)
    ngram = next((row["speedup"] for row in rows if row["method"] == "ngram"), None)
    header = ["method", "tok/s", "speed-up", "spread", "vs ngram", "accept", "acc len",
              "identical"]
    line = "{:<26}{:>7}{:>9}{:>12}{:>9}{:>8}{:>9}{:>10}"
    if args.diagnostics:
        header += ["machine", "c", "F", "S*", "meas/S*", "rounds self/lookup/none %",
                   "mechanism % (acc) / base acc"]
        line += "{:>8}{:>6}{:>6}{:>6}{:>8}  {:<26}{}"
    print(line.format(*header), file=CONSOLE)
    for row in rows:
        cells = [row["method"], row["tokens_per_s"], f"{row['speedup']:.2f}x",
                 "{:.2f}-{:.2f}".format(*row["speedup_spread"]),
                 "-" if ngram is None else f"{row['speedup'] / ngram:.2f}x",
                 _fmt(row["acceptance"]),
                 _fmt(row["mean_accepted_length"]), row["identical_to_plain"]]
        if args.diagnostics:
            machine = row.get("machine_vs_plain_starts")
            cells += [
                _fmt(statistics.geometric_mean(machine) if machine else None),
                _fmt(row.get("draft_step_cost_ratio")), _fmt(row.get("round_overhead")),
                _fmt(row.get("ideal_speedup_S*")), _fmt(row.get("measured_over_S*")),
                "/".join(f"{100 * share:.0f}" for share in row["round_sources"].values())
                if "round_sources" in row else "-", _mechanism_cell(row)]
        print(line.format(*cells), file=CONSOLE)
    if "by_prompt_set" in rows[0]:
        print_prompt_sets(rows)
    print(reading(rows, args.dtype), file=CONSOLE)
    warnings = machine_warnings(rows)
    if args.diagnostics:
        for warning in warnings:
            print(f"warning: {warning}", file=CONSOLE)
    elif warnings:
        print(f"(The machine's own speed moved by more than {MACHINE_TOLERANCE:.0%} during "
              f"{len(warnings)} engine start(s); --diagnostics says which.)", file=CONSOLE)


def _mechanism_cell(row: dict) -> str:
    """The share of self-drafts the method's mechanism made, its acceptance,
    and the full-depth base's acceptance."""
    share = row.get("self_drafts_by_mechanism")
    if share is None:
        return "-"
    return (f"{100 * share:.0f} ({_fmt(row['mechanism_acceptance'])}) / "
            f"{_fmt(row['base_acceptance'])}")


def machine_warnings(rows: list[dict]) -> list[str]:
    """One sentence per engine start during which the machine ran at another
    speed than during plain's same start: that start's ratio is partly the machine's."""
    warnings = []
    for row in rows:
        for start, ratio in enumerate(row.get("machine_vs_plain_starts", []), 1):
            if abs(ratio - 1) > MACHINE_TOLERANCE:
                warnings.append(
                    f"the machine ran at {ratio:.2f}x its speed during plain's start {start} "
                    f"while {row['method']} decoded (probe: {row['machine_GBps_starts'][start - 1]}"
                    f" GB/s): that start's ratio measures the machine as much as the method")
    return warnings


def print_prompt_sets(rows: list[dict]) -> None:
    """Speed-up per prompt set and, for the sets, how rounds drafted."""
    sets = list(rows[0]["by_prompt_set"])
    line = "{:<26}" + "{:>24}" * len(sets)
    print("\nby prompt set: speed-up (rounds self/lookup/none %)", file=CONSOLE)
    print(line.format("method", *sets), file=CONSOLE)
    for row in rows[1:]:
        cells = []
        for name in sets:
            entry = row["by_prompt_set"][name]
            sources = "/".join(f"{100 * share:.0f}" for share in
                               entry["round_sources"].values()) if "round_sources" in entry else "-"
            cells.append(f"{entry['speedup']:.2f}x ({sources})")
        print(line.format(row["method"], *cells), file=CONSOLE)


def reading(rows: list[dict], dtype: str) -> str:
    """The table in one plain sentence (and one more when outputs differ)."""
    best = max(rows[1:], key=lambda row: row["speedup"], default=None)
    if best is None:
        return ""
    text = f"\n{best['method']} decodes {best['speedup']:.2f}x as fast as plain vLLM here"
    ngram = next((row for row in rows if row["method"] == "ngram"), None)
    if ngram is not None and ngram is not best:
        text += f" (vLLM's ngram: {ngram['speedup']:.2f}x)"
    text += f", its outputs identical to plain vLLM's in {best['identical_to_plain']} prompts."
    same, total = best["identical_to_plain"].split("/")
    if same != total and dtype != "float32":
        text += (f" In {dtype} a verification scores several tokens at once and its rounding "
                 "can flip a near-tie (vLLM's own methods do too); in float32 outputs are "
                 "identical, which the tests check.")
    return text


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def serving_ratios(rows: list[dict]) -> dict[tuple[str, int, float], list[float]]:
    """Each setting's throughput over plain's, one ratio per start: paired
    rows (with a `pair`) over the runs of the plain server beside it, as
    geometric means of their runs; bracketed rows over the geometric mean of
    the plain servers run just before and just after the start (plain's
    `start` s and s + 1)."""
    def speed(group: list[dict]) -> float:
        return statistics.geometric_mean([r["output_throughput"] for r in group])

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["setting"] != "plain":
            groups.setdefault((row["setting"], row["concurrency"], row["temperature"],
                               row.get("pair"), row["start"]), []).append(row)
    found: dict[tuple[str, int, float], list[float]] = {}
    for (setting, concurrency, temperature, pair, start), group in groups.items():
        plain = [r for r in rows if r["setting"] == "plain"
                 and r["concurrency"] == concurrency and r["temperature"] == temperature
                 and (r.get("pair") == pair if pair is not None
                      else r.get("pair") is None and r["start"] in (start, start + 1))]
        if plain:
            found.setdefault((setting, concurrency, temperature), []).append(
                speed(group) / speed(plain))
    return found


def serving_table(rows: list[dict], args) -> str:
    """The serving sweep's markdown: each setting's throughput over plain's per
    concurrency and temperature (geometric mean over starts, range, acceptance,
    share of rounds drafted), and plain's own tokens/s."""
    found = serving_ratios(rows)
    lines = [f"`{' '.join(sys.argv)}` · CPU flags: {' '.join(cpu_flags()) or 'none'} · "
             f"{args.dtype} · {args.starts} start(s), "
             + ("plain's servers around each" if getattr(args, "bracketed", False)
                else "each beside its own plain server, runs ABBA"), "",
             "| setting | temperature | " + " | ".join(f"C={c}" for c in args.concurrency) + " |",
             "|---|---|" + "---|" * len(args.concurrency)]
    for setting in [s for s in args.settings if s != "plain"]:
        for temperature in args.temperatures:
            cells = []
            for concurrency in args.concurrency:
                values = found.get((setting, concurrency, temperature))
                if not values:
                    cells.append("-")
                    continue
                mine = [r for r in rows if r["setting"] == setting
                        and r["concurrency"] == concurrency and r["temperature"] == temperature]
                share = [r["drafted_share"] for r in mine if r["drafted_share"] is not None]
                acc = [r["acceptance"] for r in mine if r["acceptance"] is not None]
                spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
                extra = []
                if acc:
                    extra.append(f"acc {statistics.fmean(acc):.2f}")
                if share:
                    extra.append(f"drafted {statistics.fmean(share):.0%}")
                cells.append(f"**{statistics.geometric_mean(values):.2f}x**{spread}"
                             + (f"<br>{', '.join(extra)}" if extra else ""))
            lines.append(f"| {setting} | {temperature} | " + " | ".join(cells) + " |")
    plain = [r for r in rows if r["setting"] == "plain"]
    lines += ["", "Plain vLLM's output tokens/s (median TPOT ms) per concurrency, over its servers: "
              + "; ".join(
                  f"T={t} C={c}: " + ", ".join(
                      f"{r['output_throughput']:.1f} ({r['median_tpot_ms']:.0f})"
                      for r in plain if r["concurrency"] == c and r["temperature"] == t)
                  for t in args.temperatures for c in args.concurrency)]
    return "\n".join(lines) + "\n"
