"""The weights a draft reads: the target's own, or a low-precision copy of them.

A draft step on a memory-bound device costs about the weight bytes it reads,
so a full-depth draft over an int8 copy of every linear weight costs about
half a bf16 step while agreeing with the target on nearly every token.
Verification always runs the target's own weights, so outputs stay the
target's; only acceptance can change.

`DraftWeights.build` makes, from the loaded target:
- `layers`: the target's decoder layers, or shallow clones of them in which
  every vLLM linear layer (`LinearBase`) runs through vLLM's own quantised
  kernel over a copy of its weight. Everything else (attention and its KV
  cache, norms, rotary embedding, tensor-parallel collectives in the linears'
  `forward`) is the target's, shared, so each rank quantises its own shard. On
  the CPU the layers call their attention through one op (`attention.py`).
- `compute_logits`: the target's LM head, or a draft head over a low-precision
  copy and/or a frequent-token subset of its rows (`draft_vocab`); logits
  outside the subset are -inf, so a draft never leaves it.

The kernels behind the copies are in `kernels.py`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from vllm.logger import init_logger

from vllm_selfspec.draft.attention import DraftAttention, one_op_attention, takes_draft_attention
from vllm_selfspec.draft.kernels import LOW_PRECISION_LINEARS, int8_runs_fbgemm

# Under "vllm." so it shows with vLLM's own start-up log lines.
logger = init_logger(f"vllm.{__name__}")


class DraftLinearMethod:
    """A `quant_method` for a cloned vLLM linear layer: its `forward` (and so
    its tensor-parallel gather or all-reduce and bias rules) stays vLLM's, only
    the matrix multiply runs over the low-precision copy."""

    def __init__(self, linear: nn.Module) -> None:
        self.linear = linear

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x, bias)


# Where a linear layer keeps its draft copy: in its __dict__, outside the module
# tree, so the target's parameters, state dict and compiled graph never see it.
STASH = "_selfspec_draft_linear"


def stash_low_precision_copy(linear: nn.Module, precision: str | None,
                             dtype: torch.dtype) -> None:
    """Called as the target's weights finish loading (see integration/patches.py)."""
    if precision not in LOW_PRECISION_LINEARS:
        return
    weight = getattr(linear, "weight", None)
    if weight is None or weight.ndim != 2 or weight.is_meta:
        return
    from vllm.utils.torch_utils import set_default_torch_dtype

    widths = getattr(linear, "output_partition_sizes", None) or [weight.shape[0]]
    # vLLM's CPU int8 kernel takes its output dtype from the default dtype.
    with set_default_torch_dtype(dtype):
        copy_ = LOW_PRECISION_LINEARS[precision](weight, linear.bias, widths)
    linear.__dict__[STASH] = copy_


def low_precision_clone(linear: nn.Module) -> nn.Module:
    """A shallow copy of a vLLM linear layer drafting through the copy of its
    weight shard made at load time; the original is untouched."""
    quantized = linear.__dict__.get(STASH)
    if quantized is None:
        raise ValueError(
            f"speculative_config.draft_precision: the target's {type(linear).__name__} "
            "has no low-precision copy (a quantised checkpoint, or weights loaded "
            "without the plugin); use an unquantised model or leave draft_precision "
            "unset.")
    clone = copy.copy(linear)
    clone.__dict__.pop(STASH, None)
    clone._parameters = {k: v for k, v in linear._parameters.items() if k != "weight"}
    clone._modules = dict(linear._modules)
    clone._buffers = dict(linear._buffers)
    clone.draft_linear = quantized
    clone.quant_method = DraftLinearMethod(quantized)
    return clone


def replace_modules(module: nn.Module, matches: Callable[[nn.Module], bool],
                    replace: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """`module`, with every module below it that `matches` replaced: ancestors
    of a replaced module are shallow clones, everything else is shared."""
    if matches(module):
        return replace(module)
    children = dict(module.named_children())
    new_children = {name: replace_modules(child, matches, replace)
                    for name, child in children.items()}
    if all(new_children[name] is child for name, child in children.items()):
        return module
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._modules.update(new_children)
    return clone


def replace_linears(module: nn.Module, replace: Callable[[nn.Module], nn.Module]
                    ) -> nn.Module:
    """`module`, with every vLLM linear layer below it replaced."""
    from vllm.model_executor.layers.linear import LinearBase

    return replace_modules(module, lambda m: isinstance(m, LinearBase), replace)


# --- the draft head ---------------------------------------------------------
def _all_gather_ints(values: torch.Tensor) -> torch.Tensor:
    """Every tensor-parallel rank's `values` (1-D, non-negative integers below
    2**24), concatenated in rank order. They travel as float32, exact in that
    range: vLLM's CPU all-gather (shared memory) has no int64 kernel."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(values.view(1, -1).float()).view(-1).long()


class DraftHead(nn.Module):
    """The target's LM head for drafts: its rows for a token subset (all of
    the rank's vocabulary shard without one), at the draft's precision.

    Logits are returned over the full vocabulary (-inf outside the subset),
    as every draft-side consumer (argmax, confidence, DEL's shadow tokens)
    expects; under tensor parallelism each rank computes its shard's rows and
    the shards are all-gathered, so every rank sees the same logits."""

    def __init__(self, target: nn.Module, precision: str,
                 token_ids: list[int] | None) -> None:
        super().__init__()
        from vllm.distributed import get_tensor_model_parallel_world_size

        lm_head, processor = target.lm_head, target.logits_processor
        shard = lm_head.shard_indices
        start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
        device = lm_head.weight.device
        if token_ids is None:
            local = torch.arange(start, end, device=device)
        else:
            ids = torch.tensor(sorted(set(token_ids)), device=device)
            local = ids[(ids >= start) & (ids < end)]
        weight = lm_head.weight.detach()[local - start]
        self.vocab_size = processor.org_vocab_size
        self.scale, self.soft_cap = processor.scale, processor.soft_cap
        self.tp_size = get_tensor_model_parallel_world_size()
        if precision in LOW_PRECISION_LINEARS:
            self.linear = LOW_PRECISION_LINEARS[precision](weight, None, [weight.shape[0]])
            self.weight_bytes = self.linear.weight_bytes
        else:
            self.register_buffer("weight", weight.clone())
            self.linear = None
            self.weight_bytes = weight.numel() * weight.element_size()
        self.local_rows = local.numel()
        self.padded_rows = self._padded_rows(local.numel(), device)
        gathered = self._gather_ids(local)
        # Full-vocabulary logits need a scatter unless the rows already are the vocabulary.
        self.needs_scatter = token_ids is not None or self.tp_size > 1
        self.register_buffer("token_ids", gathered)

    def _padded_rows(self, rows: int, device: torch.device) -> int:
        if self.tp_size == 1:
            return rows
        return int(_all_gather_ints(torch.tensor([rows], device=device)).max())

    def _gather_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's token ids, each padded to `padded_rows` with the
        out-of-vocabulary id `vocab_size` (a scatter column that is dropped)."""
        padded = torch.full((self.padded_rows,), self.vocab_size, dtype=torch.int64,
                            device=local.device)
        padded[: local.numel()] = local
        if self.tp_size == 1:
            return padded
        return _all_gather_ints(padded)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            logits = self.linear(hidden_states)
        else:
            logits = torch.nn.functional.linear(hidden_states, self.weight)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        if not self.needs_scatter:
            return logits
        if self.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_gather

            pad = self.padded_rows - self.local_rows
            if pad:
                logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
            logits = tensor_model_parallel_all_gather(logits.contiguous())
        # Float, as the drafter reads it (`_draft_loop`): the subset's rows are
        # converted, not the whole vocabulary.
        full = torch.full((logits.shape[0], self.vocab_size + 1), float("-inf"),
                          dtype=torch.float32, device=logits.device)
        full.index_copy_(1, self.token_ids, logits.float())
        return full[:, : self.vocab_size]


# --- all of it --------------------------------------------------------------
def model_weight_bytes(target: nn.Module) -> int:
    """The target's weight bytes on this rank, counting linear weights that
    vLLM's CPU path packed away (their tensors are empty afterwards)."""
    from vllm.model_executor.layers.linear import LinearBase

    total, seen = 0, set()
    for module in target.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied embeddings: one tensor, two modules
                continue
            seen.add(id(param))
            if isinstance(module, LinearBase) and name == "weight":
                rows = getattr(module, "output_size_per_partition", module.output_size)
                cols = getattr(module, "input_size_per_partition", module.input_size)
                total += rows * cols * module.params_dtype.itemsize
            else:
                total += param.numel() * param.element_size()
    return total



@dataclass
class DraftWeights:
    """The layers and LM head a draft runs, and what the copy costs in memory."""

    layers: nn.ModuleList
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    precision: str
    extra_bytes: int
    model_bytes: int

    @classmethod
    def build(cls, target: nn.Module, layers: nn.ModuleList, precision: str | None,
              vocab_token_ids: list[int] | None, num_layers_used: int) -> DraftWeights:
        """The first `num_layers_used` layers with their linears' low-precision
        copies (made at load time; deeper ones are never drafted through and
        are dropped), and the draft head."""
        precision = precision or "auto"
        model_bytes = model_weight_bytes(target)
        low = precision in LOW_PRECISION_LINEARS
        extra = 0
        if low:
            copies: list[nn.Module] = []

            def quantize(linear: nn.Module) -> nn.Module:
                clone = low_precision_clone(linear)
                copies.append(clone)
                return clone

            layers = nn.ModuleList(
                [replace_linears(layer, quantize) if index < num_layers_used else layer
                 for index, layer in enumerate(layers)])
            extra += sum(clone.draft_linear.weight_bytes for clone in copies)
            for module in target.modules():  # copies no draft uses are freed
                module.__dict__.pop(STASH, None)
        if one_op_attention():
            layers = nn.ModuleList(
                [replace_modules(layer, takes_draft_attention, DraftAttention)
                 if index < num_layers_used else layer for index, layer in enumerate(layers)])
        compute_logits = target.compute_logits
        if low or vocab_token_ids is not None:
            # int4 keeps the head at int8: a subset's row count fits no int4
            # tiling, and the argmax over the vocabulary is where errors show.
            head = DraftHead(target, "int8" if precision == "int4" else precision,
                             vocab_token_ids)
            extra += head.weight_bytes
            compute_logits = head
        weights = cls(layers, compute_logits, precision, extra, model_bytes)
        if extra:
            logger.info(
                "vllm-selfspec draft weights (%s%s): %.1f MB extra on this rank, %.1f%% "
                "of the model's %.1f MB%s", precision,
                "" if vocab_token_ids is None else f", {len(vocab_token_ids)}-token head",
                extra / 1e6, 100 * extra / model_bytes, model_bytes / 1e6,
                "" if not low or not int8_runs_fbgemm() else
                "; int8 through PyTorch's fbgemm kernel (this CPU has no VNNI or "
                "AMX, on which vLLM's int8 kernel is slow)")
        return weights
