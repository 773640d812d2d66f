"""The replacements that `patches.py` installs into vLLM, each a few lines."""

from __future__ import annotations

from typing import Any, get_args

from vllm_selfspec.config import (
    METHOD_MODULES,
    SelfSpecConfig,
    SelfSpecConfigError,
    check_keys,
    config_class_for,
    method_module,
)
from vllm_selfspec.draft_tokens import NO_DRAFT
from vllm_selfspec.patches import original


def _vllm_methods() -> set[str]:
    from vllm.config.speculative import MTPModelTypes, SpeculativeMethod

    return set(get_args(SpeculativeMethod)) | set(get_args(MTPModelTypes))


def speculative_config_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """SpeculativeConfig(method=<ours>, ...) builds that method's subclass."""
    from vllm.config.speculative import SpeculativeConfig

    method = kwargs.get("method")
    if cls is SpeculativeConfig and isinstance(method, str):
        if method in METHOD_MODULES:
            cls = config_class_for(method)
            check_keys(cls, kwargs)
        elif method not in _vllm_methods():
            raise SelfSpecConfigError(
                f"speculative_config.method: unknown method '{method}'; use one of "
                f"vllm-selfspec's {sorted(METHOD_MODULES)} or one of vLLM's "
                f"{sorted(_vllm_methods())}."
            )
    return object.__new__(cls)


def draft_model_proposer_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """DraftModelProposer(vllm_config=<ours>) builds that method's proposer."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    spec = getattr(vllm_config, "speculative_config", None)
    if cls is DraftModelProposer and isinstance(spec, SelfSpecConfig):
        cls = method_module(spec.method).PROPOSER_CLASS
    return object.__new__(cls)


def take_draft_token_ids(self: Any) -> Any:
    """Cut each request's drafts at the first NO_DRAFT before scheduling, and
    say which a lookup made (token_sources.py)."""
    from vllm_selfspec.token_sources import SourcedDraftTokenIds

    drafts = original(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "take_draft_token_ids"
    )(self)
    if drafts is None or not isinstance(getattr(self, "speculative_config", None),
                                        SelfSpecConfig):
        return drafts
    rows = [
        row[: row.index(NO_DRAFT)] if NO_DRAFT in row else row
        for row in drafts.draft_token_ids
    ]
    looked_up = self.drafter.looked_up
    return SourcedDraftTokenIds(drafts.req_ids, rows,
                                [req_id in looked_up for req_id in drafts.req_ids])


def v2_runner_unsupported_features(self: Any) -> list[str]:
    unsupported = original(
        "vllm.config.vllm", "VllmConfig", "_get_v2_model_runner_unsupported_features"
    )(self)
    if isinstance(self.speculative_config, SelfSpecConfig):
        unsupported.append(
            f"speculative method '{self.speculative_config.method}' "
            "(vllm-selfspec drafts through the V1 runner's proposer hook)"
        )
    return unsupported


def aux_hidden_state_layers(self: Any) -> tuple[int, ...] | None:
    """The layers whose hidden states the target returns to the drafter."""
    layers = getattr(getattr(self, "drafter", None), "aux_hidden_state_layers", None)
    if layers is not None:
        return layers()
    return original(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
        "_get_eagle3_aux_layers_from_config")(self)


def quantize_linear_before_packing(self: Any, layer: Any) -> None:
    """With a low-precision draft configured, make the draft's copy of each
    unquantized linear weight while the weight is still there: vLLM's CPU
    path packs it into oneDNN and frees the tensor right after."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    from vllm_selfspec.workers.draft_weights import stash_low_precision_copy

    config = get_current_vllm_config_or_none()
    spec = getattr(config, "speculative_config", None)
    if isinstance(spec, SelfSpecConfig):
        stash_low_precision_copy(layer, spec.draft_precision, config.model_config.dtype)
    original("vllm.model_executor.layers.linear", "UnquantizedLinearMethod",
             "process_weights_after_loading")(self, layer)
