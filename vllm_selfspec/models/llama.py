"""Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) run one sub-block at a time.

vLLM's decoder layers keep the residual stream as a pending pair
(hidden_states, residual) whose sum is the stream; the fused RMSNorm adds the
pair and normalises in one op. Skipping a sub-block means adding nothing to the
stream, so a skipped attention or MLP leaves the pair unchanged. A layer that
runs both sub-blocks is called whole, so full-depth drafting computes exactly
what the target computes.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def decoder(target_model: nn.Module) -> nn.Module:
    """The module holding embed_tokens, layers and norm."""
    return target_model.model


def run_layer(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    run_attention: bool,
    run_mlp: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if run_attention and run_mlp:
        return layer(positions, hidden_states, residual)
    if run_attention:
        if residual is None:
            residual = hidden_states
            hidden_states = layer.input_layernorm(hidden_states)
        else:
            hidden_states, residual = layer.input_layernorm(hidden_states, residual)
        return layer.self_attn(positions=positions, hidden_states=hidden_states), residual
    if run_mlp:
        if residual is None:
            residual = hidden_states
            hidden_states = layer.post_attention_layernorm(hidden_states)
        else:
            hidden_states, residual = layer.post_attention_layernorm(
                hidden_states, residual
            )
        return layer.mlp(hidden_states), residual
    return hidden_states, residual
