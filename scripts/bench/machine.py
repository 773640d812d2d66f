"""These machines drift: a probe of the machine's speed during each engine start,
the rule that flags a start the machine slowed, and the orders that spread
slow spells over every engine alike."""

from __future__ import annotations

import functools
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.runner import Run


# How far the machine's speed during an engine's start may stray from its
# speed during plain's same start before that start's ratio is flagged, and
# from the run's typical speed before `--retake-drifted-starts` takes it again.
MACHINE_TOLERANCE = 0.05


# Bytes of weights the machine-speed probe streams: beyond any cache, like a
# decode step's.
PROBE_BYTES = 256 * 2**20


@functools.cache
def _probe_operands():
    import torch

    rows = 4096
    return torch.randn(rows, PROBE_BYTES // 4 // rows), torch.randn(PROBE_BYTES // 4 // rows)


def machine_speed() -> float:
    """GB/s one thread streams through a float32 matrix-vector product over
    256 MB of weights, as a decode step streams its weights. These machines' slow
    spells are in memory bandwidth while cache-resident work runs at full
    speed (docs/results/kernels-and-machine.md), so an engine start during
    which the probe read slower than during plain's has a ratio that is partly
    the machine's."""
    import torch

    weights, vector = _probe_operands()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's worker computes
    try:
        started = time.perf_counter()
        for _ in range(4):
            torch.mv(weights, vector)
        return 4 * PROBE_BYTES / (time.perf_counter() - started) / 1e9
    finally:
        torch.set_num_threads(threads)


def turns(num_engines: int, index: int) -> list[int]:
    """The engines' order for the index-th batch of prompts: the rows of a
    Williams design (a balanced Latin square, with the rows reversed too when
    the count is odd), so over a cycle of rows every engine decodes in every
    place equally often and right after each other engine equally often: a
    slow spell, or whatever an engine leaves behind for the next, lands on
    none of them more than on the others."""
    first_row = [(place // 2 + 1) if place % 2 else (num_engines - place // 2) % num_engines
                 for place in range(num_engines)]
    cycle = num_engines if num_engines % 2 == 0 else 2 * num_engines
    row = index % cycle
    order = [(engine + row) % num_engines for engine in first_row]
    return order if row < num_engines else order[::-1]


def engine_order(runs: list[Run], engine_starts: int) -> list[list[Run]]:
    """Every run once per start, each start in the next order of `turns`:
    neither a slow spell of the machine nor a place in the order (first
    after a previous engine's exit, or first of interleaved engines) lands
    on one method."""
    return [[runs[place] for place in turns(len(runs), start)] for start in range(engine_starts)]


def typical_machine_speed(runs: list[Run]) -> float:
    """The probe's median over every engine start of the run."""
    return statistics.median(speed for run in runs for speed in run.start_machine_speed)


def drifted_starts(runs: list[Run], typical: float) -> list[tuple[Run, int]]:
    """Each (run, start index) during which the probe read the machine more
    than MACHINE_TOLERANCE off `typical`: these machines slow for minutes at a time
    (docs/results/kernels-and-machine.md), so such a start's ratio is partly
    the machine's."""
    return [(run, index) for run in runs for index, speed in enumerate(run.start_machine_speed)
            if abs(speed / typical - 1) > MACHINE_TOLERANCE]


def unbalanced_first_start(num_engines: int, engine_starts: int) -> str | None:
    """A warning when interleaved engines will not each start first equally
    often: the engine started first decodes slower than the rest on these
    machines (docs/results/kernels-and-machine.md), which a ratio against it
    would carry."""
    if num_engines < 2 or engine_starts % num_engines == 0:
        return None
    return (f"{num_engines} engines interleaved over {engine_starts} start(s): not every "
            f"engine starts first equally often, and the first-started engine has run "
            f"2-16 % slower here; --engine-starts {num_engines} (or a multiple) balances it")
