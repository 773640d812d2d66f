"""The residual stream after DEL's candidate exit layers, written during the
target's forward into a buffer DEL reads afterwards for its shadow tokens.

vLLM's EAGLE-3 path hands such states back as extra outputs of the compiled
target graph. On SmolLM2, in vLLM's worker process, a target returning six
of them decoded 4-7 % slower than one returning a single state, in the same
interleaved runs (docs/results.md), even in rounds that read none. Here the
graph instead calls one opaque op per exit layer that adds the layer's
(hidden_states, residual) pair into a persistent buffer, a side effect like
vLLM's KV-cache update, and returns an empty tensor. Each op takes the one
before's result, and the last result is the graph's only extra output (of
width 0), so the compiler keeps every op and the graph's outputs stay those
of one state. The buffer's address is fixed, so under a CUDA graph the
captured adds write it again at every replay.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

# DEL's buffer in vLLM's per-engine registry of objects the compiled forward
# reaches at run time (where attention layers are found by name).
EXIT_STATES_KEY = "selfspec.exit_states"
# Set on a decoder whose exit states go to the buffer instead of the outputs.
RECORDS_EXIT_STATES = "selfspec_records_exit_states"


class ExitStates:
    """[exit, token row, hidden] of the last target forward, one slot per
    candidate exit layer in ascending order."""

    def __init__(self, layers: list[int], max_tokens: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.layers = tuple(layers)
        self.buffer = torch.zeros(len(layers), max_tokens, hidden_size, dtype=dtype,
                                  device=device)


def record_exit_state(hidden_states: torch.Tensor, residual: torch.Tensor,
                      after: torch.Tensor, slot: int) -> torch.Tensor:
    """Write the stream after one exit layer into its slot; `after` (the
    previous op's result) orders the ops and is otherwise unused."""
    from vllm.forward_context import get_forward_context

    del after
    states: ExitStates = get_forward_context().no_compile_layers[EXIT_STATES_KEY]
    rows = hidden_states.shape[0]
    torch.add(hidden_states, residual, out=states.buffer[slot, :rows])
    return hidden_states.new_empty((rows, 0))


def _record_exit_state_fake(hidden_states: torch.Tensor, residual: torch.Tensor,
                            after: torch.Tensor, slot: int) -> torch.Tensor:
    return hidden_states.new_empty((hidden_states.shape[0], 0))


def _register_op() -> None:
    """Once per process, in the worker (the dispatch key is the platform's)."""
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, "selfspec_record_exit_state"):
        direct_register_custom_op(
            op_name="selfspec_record_exit_state", op_func=record_exit_state,
            fake_impl=_record_exit_state_fake, mutates_args=[])


def maybe_add_hidden_state(self: Any, aux_hidden_states: list[torch.Tensor], layer_idx: int,
                           hidden_states: torch.Tensor,
                           residual: torch.Tensor | None) -> list[torch.Tensor]:
    """vLLM's, except on a decoder set up by `attach_exit_states`: there an
    exit layer's state goes to the buffer, and the list holds one empty tensor."""
    from vllm_selfspec.patches import original

    if not getattr(self, RECORDS_EXIT_STATES, False):
        return original("vllm.model_executor.models.interfaces", "EagleModelMixin",
                        "_maybe_add_hidden_state")(
            self, aux_hidden_states, layer_idx, hidden_states, residual)
    if layer_idx in self.aux_hidden_state_layers:
        after = aux_hidden_states.pop() if aux_hidden_states else hidden_states
        aux_hidden_states.append(torch.ops.vllm.selfspec_record_exit_state(
            hidden_states, residual, after, self.aux_hidden_state_layers.index(layer_idx)))
    return aux_hidden_states


def attach_exit_states(decoder: nn.Module, layers: list[int], vllm_config: Any,
                       device: torch.device) -> ExitStates:
    """Make `decoder` write the states after `layers` (ascending, all >= 1)
    into a new buffer, registered for this engine, sized for the most tokens
    a forward takes; logs its size."""
    _register_op()
    model_config = vllm_config.model_config
    max_tokens = max(vllm_config.scheduler_config.max_num_batched_tokens,
                     vllm_config.compilation_config.max_cudagraph_capture_size or 0)
    states = ExitStates(layers, max_tokens, model_config.get_hidden_size(),
                        model_config.dtype, device)
    vllm_config.compilation_config.static_forward_context[EXIT_STATES_KEY] = states
    setattr(decoder, RECORDS_EXIT_STATES, True)
    logger.info("vllm-selfspec DEL exit states: %d layers x %d tokens, %.1f MB",
                len(layers), max_tokens,
                states.buffer.numel() * states.buffer.element_size() / 2**20)
    return states
