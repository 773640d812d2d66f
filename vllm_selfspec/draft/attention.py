"""The draft's attention on the CPU: the target's own `Attention` layers,
KV cache and kernels, called through one lean op per layer.

vLLM's `Attention.forward` makes two custom-op calls per layer (the KV-cache
write, then attention), each resolving its layer from the forward context and
re-deriving the cache views in Python before its kernel runs. A draft step runs
a whole model's layers for a token or a few, and on the CPU no graph replay
hides that host time, so it is a large share of the step.
`DraftAttention` makes one call, `selfspec::draft_attention`, that runs vLLM's
CPU backend's two kernels (`cpu_attn_reshape_and_cache`,
`cpu_attention_with_kv_cache`) with the arguments its `do_kv_cache_update` and
`forward` would give them, the per-layer ones read once per KV cache: the same
paged blocks and the same metadata vLLM's ops read. Its layer argument is the
layer's name as a plain string, which inductor's C++ wrapper can pass (vLLM's
`LayerName` object cannot), so draft graphs are compiled with a C++ host
wrapper (`draft/model.py`, `draft_compile_config`).

Only decoder layers of vLLM's CPU backend with their own KV cache, no
attention sinks and no quantised queries take it; GPU drafts keep vLLM's ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from torch.library import Library
from vllm.forward_context import get_forward_context

_LIBRARY = Library("selfspec", "FRAGMENT")  # kept alive: the op lives as long as it


class _CpuLayer(NamedTuple):
    """What `cpu_attention_with_kv_cache` and `cpu_attn_reshape_and_cache`
    take for a layer besides the step's tensors, read once per KV cache."""

    layer: nn.Module
    kv_cache: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    isa: str
    scale: float
    alibi_slopes: torch.Tensor | None
    sliding_window: int
    softcap: float
    k_scale: float
    v_scale: float
    kv_cache_dtype: str


# Per layer name, its kernels' arguments; rebuilt when the name's layer or KV
# cache is another (a second engine in the process): one entry per layer name.
_CPU_LAYERS: dict[str, _CpuLayer] = {}


def _cpu_layer(layer_name: str, layer: nn.Module) -> _CpuLayer:
    known = _CPU_LAYERS.get(layer_name)
    if known is not None and known.layer is layer and known.kv_cache is layer.kv_cache:
        return known
    impl, kv_cache = layer.impl, layer.kv_cache
    # vLLM's CPU backend's layout: [blocks, kv heads, block size, 2 * head size],
    # keys in the first half of each row pair.
    blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    known = _CpuLayer(layer, kv_cache, key_cache, value_cache, layer.isa, impl.scale,
                      impl.alibi_slopes, impl.sliding_window, impl.logits_soft_cap,
                      layer._k_scale_float, layer._v_scale_float, impl.kv_cache_dtype)
    _CPU_LAYERS[layer_name] = known
    return known


def draft_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    output: torch.Tensor, layer_name: str) -> None:
    """Write `key`/`value` into the layer's KV cache at the step's slots and
    attend `query` into `output`: vLLM's CPU backend's two kernels, as its
    `do_kv_cache_update` and `forward` call them for a decoder layer."""
    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    if metadata is None:  # vLLM's warm-up and profiling runs attend nothing
        return
    args = _cpu_layer(layer_name, context.no_compile_layers[layer_name])
    slots = context.slot_mapping.get(layer_name)
    if slots is not None:
        torch.ops._C.cpu_attn_reshape_and_cache(
            key, value, args.key_cache, args.value_cache, slots, args.isa, args.k_scale,
            args.v_scale, args.kv_cache_dtype)
    tokens = metadata.num_actual_tokens
    if tokens < query.shape[0]:
        query, output = query[:tokens], output[:tokens]
    torch.ops._C.cpu_attention_with_kv_cache(
        query, args.key_cache, args.value_cache, output, metadata.query_start_loc,
        metadata.seq_lens, args.scale, metadata.causal, args.alibi_slopes,
        args.sliding_window, metadata.block_table, args.softcap,
        metadata.scheduler_metadata, None, metadata.dynamic_causal, args.k_scale,
        args.v_scale, args.kv_cache_dtype)


def _draft_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          output: torch.Tensor, layer_name: str) -> None:
    return None


def _register() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("draft_attention", draft_attention, mutates_args=["output"],
                              fake_impl=_draft_attention_fake, target_lib=_LIBRARY)


_register()


class DraftAttention(nn.Module):
    """A target `Attention` layer as the draft calls it: same signature and
    output as `Attention.forward` for self-attention with a query, key and
    value per token."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.layer_name = attention.layer_name
        self.num_heads = attention.num_heads
        self.num_kv_heads = attention.num_kv_heads
        self.head_size = attention.head_size
        self.head_size_v = attention.head_size_v

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        num_tokens = query.shape[0]
        output = torch.empty((num_tokens, self.num_heads, self.head_size_v),
                             dtype=query.dtype, device=query.device)
        torch.ops.selfspec.draft_attention(
            query.view(-1, self.num_heads, self.head_size),
            key.view(-1, self.num_kv_heads, self.head_size),
            value.view(-1, self.num_kv_heads, self.head_size_v),
            output, self.layer_name)
        return output.view(num_tokens, self.num_heads * self.head_size_v)


def takes_draft_attention(attention: nn.Module) -> bool:
    """Whether the one op can stand for vLLM's two on this module: an
    attention layer of vLLM's CPU backend, a decoder's with its own KV cache,
    no attention sinks and no quantised queries."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = getattr(attention, "impl", None)
    return (isinstance(impl, CPUAttentionBackendImpl)
            and impl.attn_type == AttentionType.DECODER and impl.sinks is None
            and attention.kv_sharing_target_layer_name is None
            and getattr(attention, "query_quant", None) is None)


def one_op_attention() -> bool:
    """Drafts call attention through `DraftAttention` on the CPU, where no
    CUDA graph hides per-op host time (measured there, docs/results/cheap-drafts.md);
    GPU drafts keep vLLM's ops."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
