"""Attention metadata for the draft forwards, built from the verification
forward's: one query token per request (a draft step), the tokens of a window
ending there (AdaDecode's deferred layers), and one request's tokens as a
causal query over its KV (SWIFT's scoring). `arange` and `token_arange_np`
are the proposer's index buffers (vLLM's, on the device and the host),
`block_size` is the KV cache's."""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata


def decode_metadata(cad: CommonAttentionMetadata, num_rejected_tokens_gpu: torch.Tensor | None,
                    arange: torch.Tensor, token_arange_np: np.ndarray
                    ) -> CommonAttentionMetadata:
    """One query token per request, ending at its last accepted token."""
    batch_size = cad.batch_size()
    seq_lens = cad.seq_lens
    if num_rejected_tokens_gpu is not None:
        seq_lens = seq_lens - num_rejected_tokens_gpu
    return cad.replace(
        seq_lens=seq_lens.clone(),
        num_actual_tokens=batch_size,
        max_query_len=1,
        query_start_loc=arange[: batch_size + 1],
        query_start_loc_cpu=torch.from_numpy(
            token_arange_np[: batch_size + 1]
        ).clone(),
        positions=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


def window_metadata(cad: CommonAttentionMetadata, positions: torch.Tensor, width: int,
                    arange: torch.Tensor, token_arange_np: np.ndarray, block_size: int
                    ) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """`cad` (one query token per request, at `positions`) widened to the
    `width` tokens ending there; returns it and their flat positions."""
    batch_size = positions.shape[0]
    offsets = torch.arange(1 - width, 1, device=positions.device)
    window = (positions.view(-1, 1) + offsets).clamp(min=0).view(-1)
    rows = torch.arange(batch_size, device=positions.device).repeat_interleave(width)
    blocks = cad.block_table_tensor[rows, window // block_size]
    slots = (blocks.long() * block_size + window % block_size).view(-1, width)
    # The newest token's slot as the proposer's `_advance` set it (padding
    # past max_model_len).
    slots[:, -1] = cad.slot_mapping[:batch_size]
    slots = slots.view(-1)
    starts = arange[: batch_size + 1] * width
    widened = cad.replace(
        query_start_loc=starts,
        query_start_loc_cpu=torch.from_numpy(
            token_arange_np[: batch_size + 1] * width),
        num_actual_tokens=batch_size * width,
        max_query_len=width,
        slot_mapping=slots,
        positions=window,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
    return widened, window


def request_window(cad: CommonAttentionMetadata, row: int, start: int, width: int,
                   device: torch.device) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """Metadata for one request's `width` tokens from position `start`, as
    a causal query over its KV (row `row` of `cad`'s block table); the slot
    mapping is a placeholder: callers read the cache and write nothing."""
    positions = torch.arange(start, start + width, device=device)
    seq_len = start + width
    window = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, width], dtype=torch.int32, device=device),
        query_start_loc_cpu=torch.tensor([0, width], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        num_reqs=1,
        num_actual_tokens=width,
        max_query_len=width,
        max_seq_len=seq_len,
        block_table_tensor=cad.block_table_tensor[row:row + 1],
        slot_mapping=torch.full((width,), -1, dtype=torch.int64, device=device),
        positions=positions,
        seq_lens_cpu_upper_bound=torch.tensor([seq_len], dtype=torch.int32),
    )
    return window, positions
