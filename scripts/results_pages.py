"""Write the run tables that open the pages of docs/results/ from the result
files under results/: each run's date, CPU, dtype, code and command as its
file records them, and its headline figures computed from the file's rows
(batch 1: each setting's speed over plain's; serving: each setting's
throughput over plain's per clients in flight and temperature).

A table sits between `<!-- runs: A=name; B=name1,name2; ... -->` and
`<!-- /runs -->`: one row per run label, from results/<name>.json.

    python scripts/results_pages.py           # rewrite the tables
    python scripts/results_pages.py --check   # exit 1 if a page is out of date
"""

from __future__ import annotations

import json
import re
import statistics

from bench.report import serving_ratios
from doc_tables import rewrite_or_check

from vllm_selfspec.assets import ROOT

PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
RESULTS = ROOT / "results"
BLOCK = re.compile(r"(<!-- runs: ([^>]*?) -->\n)(.*?)(<!-- /runs -->)", re.S)
HEADER = ("| run | date | CPU | dtype | code | headline figures | command |\n"
          "|---|---|---|---|---|---|---|\n")
DTYPES = {"bfloat16": "bf16"}


def runs_of(spec: str) -> list[tuple[str, list[str]]]:
    """`A=x; B=y,z` as [("A", ["x"]), ("B", ["y", "z"])]."""
    runs = []
    for item in spec.split(";"):
        label, names = item.strip().split("=", 1)
        runs.append((label, names.split(",")))
    return runs


def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"results/{name}.json: a page's run table names it, but it is not there")
    return json.loads(path.read_text())


def command_cell(result: dict) -> str:
    if "command_md" in result:
        return result["command_md"]
    command = result.get("command") or "python " + " ".join(result.get("argv", []))
    return f"`{command}`"


def cpu_cell(result: dict) -> str:
    flags = result.get("cpu_flags")
    flags = f"`{' '.join(flags)}`" if flags else ""
    cpu = result.get("cpu", "")
    if cpu and flags and "`" not in cpu:
        return f"{cpu} ({flags})"
    return cpu or flags or "not recorded"


def headline(result: dict) -> str:
    """The figures a run is cited for, computed from its rows."""
    rows = result.get("rows")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return "-"
    if "speedup" in rows[0]:
        plain = [row for row in rows if row["method"] == "plain"]
        cells = [f"plain {plain[0]['tokens_per_s']:.1f} tok/s"] if plain else []
        return "; ".join(cells + [f"{row['method']} {row['speedup']:.2f}x"
                                  for row in rows if row["method"] != "plain"
                                  and row.get("speedup") is not None])
    if "setting" in rows[0]:
        ratios = serving_ratios(rows)
        temperatures = sorted({t for _, _, t in ratios})
        cells = []
        for setting in dict.fromkeys(s for s, _, _ in ratios):
            per_clients = []
            for clients in sorted({c for s, c, _ in ratios if s == setting}):
                figures = [ratios.get((setting, clients, t)) for t in temperatures]
                per_clients.append(f"C{clients} " + "/".join(
                    "-" if f is None else f"{statistics.geometric_mean(f):.2f}x"
                    for f in figures))
            cells.append(f"{setting}: " + ", ".join(per_clients))
        legend = " / ".join("greedy" if t == 0 else f"T {t:g}" for t in temperatures)
        return f"over plain ({legend}): " + "; ".join(cells)
    return "-"


def row(letter: str, names: list[str]) -> str:
    results = [load(name) for name in names]
    first = results[0]
    figures = [headline(result) for result in results]
    figures = (figures[0] if len(results) == 1 else
               "; ".join(f"{name}: {figure}" for name, figure in zip(names, figures)
                         if figure != "-") or "-")
    cells = [letter, first.get("date", "not recorded"), cpu_cell(first),
             first.get("dtype_md") or DTYPES.get(first.get("dtype"), first.get("dtype", "not recorded")),
             first.get("code", "not recorded"), figures, command_cell(first)]
    return "| " + " | ".join(cells) + " |\n"


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + HEADER + "".join(
        row(letter, names) for letter, names in runs_of(m.group(2))) + m.group(4), text)


def main() -> None:
    rewrite_or_check(__doc__.splitlines()[0], PAGES, render, "results_pages.py")


if __name__ == "__main__":
    main()
