"""The draft model: a compiled module over a subset of the target's own layers.

It holds no KV cache of its own, and no weights beyond the low-precision
copies `DraftWeights` may make of the target's. Its attention sub-blocks are
the target's `Attention` modules, so they find the target's KV cache and the
drafter's metadata under the target's layer names in the forward context, and
draft KV lands in the target's paged blocks. Which sub-blocks run is fixed per
module (a `LayerPlan`), so vLLM compiles the draft into one graph like any
model: the draft step pays for the layers it runs, not for Python per layer.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn as nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, set_current_vllm_config

from vllm_selfspec.draft.plan import LayerPlan
from vllm_selfspec.draft.weights import DraftWeights


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1})
class LayerSubsetDraft(nn.Module):
    """Embedding, the planned sub-blocks of the target's layers, final norm."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        prefix: str = "",
        target: nn.Module,
        adapter: ModuleType,
        weights: DraftWeights,
        plan: LayerPlan,
    ) -> None:
        super().__init__()
        decoder = adapter.decoder(target)
        if len(weights.layers) != plan.num_layers:
            raise ValueError(
                f"layer plan covers {plan.num_layers} layers, model has "
                f"{len(weights.layers)}"
            )
        # Registered as submodules so compiled graphs bind the shared weights.
        self.embed_tokens = decoder.embed_tokens
        self.layers = weights.layers
        self.norm = decoder.norm
        self.plan = plan
        self._run_layer = adapter.run_layer
        self._compute_logits = weights.compute_logits

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = (
            inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        )
        return _run_plan(self.layers, self.norm, self._run_layer, self.plan, hidden_states,
                         positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self._compute_logits(hidden_states)


class EagerPlanDraft(nn.Module):
    """The same draft as `LayerSubsetDraft`, uncompiled: for plans chosen while
    serving (SWIFT's candidates and learned sets, the skip-set search)."""

    def __init__(self, target: nn.Module, adapter: ModuleType, weights: DraftWeights,
                 plan: LayerPlan) -> None:
        super().__init__()
        self.decoder = adapter.decoder(target)
        self.layers = weights.layers
        self.plan = plan
        self._run_layer = adapter.run_layer
        self._compute_logits = weights.compute_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = (
            inputs_embeds if inputs_embeds is not None else self.decoder.embed_tokens(input_ids)
        )
        return _run_plan(self.layers, self.decoder.norm, self._run_layer, self.plan,
                         hidden_states, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self._compute_logits(hidden_states)


def _run_plan(layers, norm, run_layer, plan: LayerPlan, hidden_states: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    residual = None
    for index, layer in enumerate(layers):
        hidden_states, residual = run_layer(layer, positions, hidden_states, residual,
                                            plan.attention[index], plan.mlp[index])
    if residual is None:
        return norm(hidden_states)
    hidden_states, _ = norm(hidden_states, residual)
    return hidden_states


@contextmanager
def draft_compile_config(vllm_config: VllmConfig, layers: nn.Module) -> Iterator[VllmConfig]:
    """The config to build a compiled draft module over `layers` under (as
    its `vllm_config`, and current while it is built, when vLLM's compile
    wrapper reads its inductor options). Where every attention layer among
    `layers` is called through `DraftAttention` (on the CPU), a copy whose
    inductor options add `cpp_wrapper`: the draft graph's host code, a few
    calls per layer run for one token, is C++ instead of Python. vLLM's own
    attention ops take a layer-name object that C++ wrapper code cannot pass,
    so a draft with any of them keeps vLLM's options, as the target's graph
    does; the copy's cache key differs, so their compiled files never mix."""
    from vllm.model_executor.layers.attention import Attention

    if any(isinstance(module, Attention) for module in layers.modules()):
        yield vllm_config
        return
    config = copy.copy(vllm_config)
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.inductor_compile_config = {
        **vllm_config.compilation_config.inductor_compile_config, "cpp_wrapper": True}
    with set_current_vllm_config(config):
        yield config


# Part of every draft graph's cache key: raised whenever what a draft's first
# compiled call traces changes, so that no graph traced by an earlier version
# (before every draft's first call ran at the profiling size, a one-token graph
# of the full-depth base) is ever loaded.
GRAPH_CACHE_VERSION = 3


def key_compile_cache(module: nn.Module, key: str) -> None:
    """vLLM's AOT compile cache (VLLM_USE_AOT_COMPILE, on by default) files a
    compiled graph under the config's hash and the forward's qualified name,
    not the model tag: instances of one class running different layers (exit
    segments, draft plans) would share one file and could load each other's
    graph. The forward that key is taken from gets a name carrying `key`; it
    runs the same code, and the compiled callable was captured before. Call it
    on a constructed module (the decorator's set-up runs after `__init__`)."""
    from vllm import envs

    if not envs.VLLM_USE_AOT_COMPILE or getattr(module, "do_not_compile", True):
        return
    function = type(module).forward
    named = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                               function.__defaults__, function.__closure__)
    named.__kwdefaults__ = function.__kwdefaults__
    named.__qualname__ = f"{function.__qualname__}[{key}, v{GRAPH_CACHE_VERSION}]"
    module.forward = types.MethodType(named, module)
