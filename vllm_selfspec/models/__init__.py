"""Model adapters: how the draft engine reaches each architecture's layers."""

from __future__ import annotations

from types import ModuleType

import torch.nn as nn

from vllm_selfspec.config import SUPPORTED_ARCHITECTURES
from vllm_selfspec.models import llama

ADAPTERS: dict[str, ModuleType] = {arch: llama for arch in SUPPORTED_ARCHITECTURES}


def adapter_for(target_model: nn.Module) -> ModuleType:
    name = type(target_model).__name__
    if name not in ADAPTERS:
        raise ValueError(
            f"speculative_config.method: vllm-selfspec has no layer adapter for "
            f"{name}; supported: {', '.join(sorted(ADAPTERS))}."
        )
    return ADAPTERS[name]
