"""Is the process started first slower, without vLLM?

Interleaved benchmark runs on these machines show the engine started first in a start
decoding slower than the others from its first request to its last
(docs/results/kernels-and-machine.md). This probe asks
whether that needs vLLM at all: each worker process holds `--weights-gb` of bf16
weights and decodes like batch-1 vLLM (every weight matrix through `F.linear`
once per pass, one thread pinned to core 0, as vLLM's CPU worker runs); the
workers start one after another, each start rotating who is first, then take
turns in the benchmark's own order (`turns`), and each worker's median seconds
per pass is printed by start-up place. `--dummy-gb` starts an idle process
first (holding that much memory), `--ballast-gb` has this process hold memory
touched before the workers start, to tell "started first" from "given the
memory freed last".

    python scripts/lab/start_order_probe.py --weights-gb 5 --starts 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench package

import torch

from vllm_selfspec.assets import cpu_flags

ROWS, COLS = 8960, 1536  # Qwen2.5-1.5B's MLP up-projection weight (out, in)


def decode_worker(conn: Connection, weights_gb: float) -> None:
    """Hold the weights, then time `passes` passes per request until told None."""
    import torch.nn.functional as F

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    count = max(1, int(weights_gb * 2**30 / (ROWS * COLS * 2)))
    weights = [torch.randn(ROWS, COLS, dtype=torch.bfloat16) for _ in range(count)]
    hidden = torch.randn(1, COLS, dtype=torch.bfloat16)
    for weight in weights:  # first calls create the kernels: not timed
        F.linear(hidden, weight)
    conn.send(count)
    while (passes := conn.recv()) is not None:
        began = time.perf_counter()
        for _ in range(passes):
            for weight in weights:
                F.linear(hidden, weight)
        conn.send((time.perf_counter() - began) / passes)


def spawn_worker(context, weights_gb: float) -> tuple[multiprocessing.Process, Connection]:
    """A started worker and its pipe, once it holds its weights and has run its kernels."""
    parent_end, child_end = context.Pipe()
    process = context.Process(target=decode_worker, args=(child_end, weights_gb))
    process.start()
    parent_end.recv()
    return process, parent_end


def run_start(start: int, args: argparse.Namespace) -> list[dict]:
    """One start: workers started in this start's order, then `--turns` turns."""
    # Imported here: spawned workers import this module and need only torch, not vLLM.
    from bench.machine import turns

    context = multiprocessing.get_context("spawn")
    ballast = torch.ones(int(args.ballast_gb * 2**28)) if args.ballast_gb else None
    started = {"dummy": spawn_worker(context, args.dummy_gb)} if args.dummy_gb else {}
    order = turns(args.workers, start)
    for worker in order:
        started[worker] = spawn_worker(context, args.weights_gb)
    pipes = {worker: pipe for worker, (_, pipe) in started.items()}
    del ballast
    seconds: dict[int, list[float]] = {worker: [] for worker in order}
    for turn in range(args.turns):
        for worker in turns(args.workers, turn):
            pipes[worker].send(args.passes)
            seconds[worker].append(pipes[worker].recv())
    for pipe in pipes.values():
        pipe.send(None)
    for process, _ in started.values():
        process.join()
    return [{"start": start + 1, "worker": worker, "place": order.index(worker) + 1,
             "median_s": statistics.median(seconds[worker]), "seconds": seconds[worker]}
            for worker in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights-gb", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--starts", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--passes", type=int, default=3, help="passes per turn")
    parser.add_argument("--dummy-gb", type=float, default=0.0,
                        help="start an idle process holding this much first (0: none)")
    parser.add_argument("--ballast-gb", type=float, default=0.0,
                        help="memory this process touches before the workers start")
    parser.add_argument("--name", default=None, help="write runs/<name>.json")
    args = parser.parse_args()
    print(f"CPU flags: {' '.join(cpu_flags())}")
    rows = []
    for start in range(args.starts):
        for row in run_start(start, args):
            rows.append(row)
            print(f"start {row['start']}: worker {row['worker']} started {row['place']}.: "
                  f"{row['median_s'] * 1e3:.1f} ms per pass (median of {args.turns})")
    firsts = [row for row in rows if row["place"] == 1]
    for first in firsts:
        rest = [row["median_s"] for row in rows
                if row["start"] == first["start"] and row["place"] > 1]
        penalty = first["median_s"] / statistics.mean(rest) - 1
        print(f"start {first['start']}: first-started {penalty:+.1%} against the others")
    if args.name:
        from vllm_selfspec.assets import RESULTS_DIR as RESULTS

        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{args.name}.json"
        command = "python scripts/lab/start_order_probe.py " + " ".join(sys.argv[1:])
        path.write_text(json.dumps({"command": command, "cpu_flags": cpu_flags(), "rows": rows},
                                   indent=1))
        print(f"saved {path}")


if __name__ == "__main__":
    main()
