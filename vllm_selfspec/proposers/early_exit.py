"""What the early-exit methods (AdaDecode, DEL) share: exit heads and the
draft as a chain of exit segments.

A draft token runs the target's layers segment by segment, one segment per
exit layer; at an exit the head input is T_E . final_norm(h_E) (T_E from a
trained heads file, or the identity: the model's own LM head, as LayerSkip
models are trained to use), and the target's own LM head gives the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
from vllm.compilation.backends import set_model_tag
from vllm.config.utils import config

from vllm_selfspec.config import CONFIGS_DIR, SelfSpecConfig, SelfSpecConfigError
from vllm_selfspec.models import adapter_for
from vllm_selfspec.proposers.base import SelfSpecProposer
from vllm_selfspec.workers.draft_model import key_compile_cache
from vllm_selfspec.workers.exit_heads import (
    ExitDraft,
    ExitHeads,
    ExitSegment,
    HeadsFileError,
    local_final_norm,
    model_identity,
)


@config
class EarlyExitConfig(SelfSpecConfig):
    heads: str | None = None
    """Directory of trained exit heads (heads.json + heads.safetensors), a path
    or a name under vllm_selfspec/configs/heads/."""
    exit_layers: list[int] | None = None
    """Exit layers to use (an exit after E layers); default: all of the heads'."""

    heads_required: ClassVar[bool] = True

    def validate_heads_field(self) -> None:
        if self.heads is None:
            if self.heads_required:
                raise SelfSpecConfigError(
                    f"speculative_config.heads: {self.method} needs trained exit "
                    "heads; train them with scripts/train_exit_heads.py and give "
                    "their directory."
                )
            return
        self.heads = str(resolve_heads(self.heads))

    def default_exit_layers(self, num_layers: int) -> list[int]:
        raise NotImplementedError

    def validate_for_model(self, num_layers: int) -> None:
        if self.heads is None:
            if self.exit_layers is None:
                self.exit_layers = self.default_exit_layers(num_layers)
            bad = [e for e in self.exit_layers if not 1 <= e <= num_layers]
            if bad or not self.exit_layers or len(set(self.exit_layers)) != len(
                    self.exit_layers):
                raise SelfSpecConfigError(
                    f"speculative_config.exit_layers: {self.exit_layers} must be distinct "
                    f"exits in 1..{num_layers} (an exit after E of the {num_layers} "
                    "layers), at least one."
                )
            self.exit_layers = sorted(self.exit_layers)
            return
        heads = open_heads(self.heads)
        hf_config = self.target_model_config.hf_config
        try:
            heads.check_shapes(hf_config)
            norm_weight = local_final_norm(self.target_model_config.model)
            if norm_weight is not None:
                heads.check_identity(model_identity(hf_config, norm_weight))
        except HeadsFileError as error:
            raise SelfSpecConfigError(str(error)) from None
        if self.exit_layers is None:
            self.exit_layers = heads.exit_layers
        unknown = sorted(set(self.exit_layers) - set(heads.exit_layers))
        if unknown or not self.exit_layers:
            raise SelfSpecConfigError(
                f"speculative_config.exit_layers: {self.exit_layers} must be a non-empty "
                f"subset of the heads' exit layers {heads.exit_layers}."
            )
        self.exit_layers = sorted(self.exit_layers)


def resolve_heads(location: str) -> Path:
    path = Path(location)
    if path.exists():
        return path.resolve()
    shipped = CONFIGS_DIR / "heads" / location
    if shipped.exists():
        return shipped
    raise SelfSpecConfigError(
        f"speculative_config.heads: no heads at '{location}' (nor {shipped}); train "
        "them with scripts/train_exit_heads.py and give their directory."
    )


def open_heads(location: str) -> ExitHeads:
    try:
        return ExitHeads.open(location)
    except HeadsFileError as error:
        raise SelfSpecConfigError(str(error)) from None


class EarlyExitProposer(SelfSpecProposer):
    """Drafts through exit segments; methods decide where each token exits."""

    options: EarlyExitConfig

    def draft_depth(self, num_layers: int) -> int:
        return max(self.options.exit_layers)

    def build_draft(self, num_layers: int) -> nn.Module:
        adapter = adapter_for(self.target_model)
        transforms: dict[int, torch.Tensor | None] = dict.fromkeys(
            self.options.exit_layers)
        if self.options.heads is not None:
            heads = ExitHeads.open(self.options.heads)
            decoder = adapter.decoder(self.target_model)
            hf_config = self.vllm_config.model_config.hf_config
            heads.check_identity(model_identity(hf_config, decoder.norm.weight))
            transforms = heads.transforms(self.options.exit_layers)
        segments, start = [], 0
        for end in self.options.exit_layers:
            with set_model_tag(f"selfspec_exit_{end}"):
                segment = ExitSegment(
                    vllm_config=self.vllm_config, target=self.target_model,
                    adapter=adapter, layers=self.draft_weights.layers, start=start, end=end,
                    transform=transforms[end])
            key_compile_cache(segment, f"exit_{start}_{end}")
            segments.append(segment)
            start = end
        return ExitDraft(segments, self.draft_weights.compute_logits, num_layers)
