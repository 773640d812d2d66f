"""Room on CPython's frame stack for a model step.

CPython (3.11 on) keeps a thread's Python frames in 16 KB chunks and unmaps a
chunk as soon as the frame that opened it returns. On the CPU, vLLM's compiled
graph calls its attention and KV-cache ops back into Python from inside a
wrapper frame that nearly fills a chunk, so each such call mapped, faulted and
unmapped a fresh chunk, dozens of times per decoded token, paid in kernel
time (docs/results/kernels-and-machine.md). A step run under one frame that opens a large chunk leaves
every frame below it room: one chunk per step instead of one per op call.
"""

from __future__ import annotations

from typing import Any, Callable

# Slots (8 bytes each) reserved in the frame that runs a step: a 64 KB frame,
# which CPython places at the start of a 128 KB chunk, leaving the step's
# frames about 56 KB, far more than a step needs below the runner.
STEP_FRAME_SLOTS = 8192


def _call(function: Callable, args: tuple, kwargs: dict) -> Any:
    return function(*args, **kwargs)


# The same function with a larger evaluation stack declared: CPython sizes a
# frame from its code object, and unused stack slots are never touched.
_call.__code__ = _call.__code__.replace(
    co_stacksize=_call.__code__.co_stacksize + STEP_FRAME_SLOTS)


def with_frame_room(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` under a frame that opens its own large chunk."""
    return _call(function, args, kwargs)
