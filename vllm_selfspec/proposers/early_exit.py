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
from vllm.logger import init_logger

from vllm_selfspec.assets import CONFIGS_DIR
from vllm_selfspec.config import METHOD_MODULES, SelfSpecConfigError
from vllm_selfspec.draft.choice import DraftChoiceConfig, local_identity
from vllm_selfspec.draft.heads import (
    ExitDraft,
    ExitHeads,
    ExitSegment,
    HeadsFileError,
    model_identity,
)
from vllm_selfspec.draft.model import draft_compile_config, key_compile_cache
from vllm_selfspec.models import adapter_for
from vllm_selfspec.proposers.base import SelfSpecProposer

logger = init_logger(f"vllm.{__name__}")

# `heads` when exits use the model's own LM head (no trained transforms).
NO_HEADS = "none"


@config
class EarlyExitConfig(DraftChoiceConfig):
    heads: str | None = None
    """Trained exit heads: a directory with heads.json and heads.safetensors
    (a path, or a name under `vllm_selfspec/configs/heads/`), checked at
    start-up against the model's shapes and weights (final-norm hash).
    Default: the heads shipped for this model, found by its weights
    (`<model>-<method>` before `<model>`)."""
    exit_layers: list[int] | None = None
    """Candidate exit layers (an exit after E layers); each adds one LM-head
    pass over a round's valid positions. Default: all of the heads' exits."""

    heads_required: ClassVar[bool] = True

    def validate_heads_field(self) -> None:
        """A given `heads` must exist; an unset one is found for the model
        (`validate_for_model`)."""
        if self.heads == NO_HEADS and self.heads_required:
            raise SelfSpecConfigError(
                f"speculative_config.heads: {self.method} needs trained exit heads, "
                f"not '{NO_HEADS}'; {TRAIN_HEADS}.")
        if self.heads not in (None, NO_HEADS):
            self.heads = str(resolve_heads(self.heads))

    @property
    def trained_heads(self) -> str | None:
        """The heads directory, or None where exits use the model's own head."""
        return None if self.heads in (None, NO_HEADS) else self.heads

    def wants_shipped_heads(self) -> bool:
        """Whether an unset `heads` means the shipped ones (else the model's
        own head at each exit)."""
        return True

    def _shipped_heads(self) -> str:
        """The heads shipped for this model, else NO_HEADS (an error where the
        method needs heads)."""
        identity = local_identity(self.target_model_config)
        found = []
        if identity is not None:
            for directory in sorted((CONFIGS_DIR / "heads").iterdir()):
                heads = ExitHeads.open(str(directory))
                if heads.meta["model"]["final_norm_sha256"] == identity["final_norm_sha256"]:
                    found.append(directory)
        own = [d for d in found if d.name.endswith(f"-{self.method}")]
        general = [d for d in found
                   if not any(d.name.endswith(f"-{method}") for method in METHOD_MODULES)]
        chosen = (own or general or [None])[0]
        if chosen is not None:
            logger.info("vllm-selfspec %s chose heads '%s' (shipped for this model); "
                        "set heads to choose otherwise.", self.method, chosen.name)
            return str(chosen)
        if self.heads_required:
            raise SelfSpecConfigError(
                f"speculative_config.heads: no exit heads are shipped for this model "
                f"and {self.method} needs them; {TRAIN_HEADS}.")
        return NO_HEADS

    def default_exit_layers(self, num_layers: int) -> list[int]:
        raise NotImplementedError

    def validate_for_model(self, num_layers: int) -> None:
        if self.heads is None:
            self.heads = self._shipped_heads() if self.wants_shipped_heads() else NO_HEADS
        if self.heads == NO_HEADS:
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
        try:
            heads.check_shapes(self.target_model_config.hf_config)
            identity = local_identity(self.target_model_config)
            if identity is not None:
                heads.check_identity(identity)
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


TRAIN_HEADS = ("train them with `python scripts/train_exit_heads.py --model MODEL_DIR` "
               "and give their directory (runs/heads/<model>) as heads")


def resolve_heads(location: str) -> Path:
    path = Path(location)
    if path.exists():
        return path.resolve()
    shipped = CONFIGS_DIR / "heads" / location
    if shipped.exists():
        return shipped
    raise SelfSpecConfigError(
        f"speculative_config.heads: no heads at '{location}' (nor {shipped}); "
        f"{TRAIN_HEADS}."
    )


def open_heads(location: str) -> ExitHeads:
    try:
        return ExitHeads.open(location)
    except HeadsFileError as error:
        raise SelfSpecConfigError(str(error)) from None


class EarlyExitProposer(SelfSpecProposer):
    """Drafts through exit segments; methods decide where each token exits."""

    options: EarlyExitConfig

    def segment_ends(self, num_layers: int) -> list[int]:
        """Where the draft's segments end: at each exit layer."""
        return list(self.options.exit_layers)

    def has_mechanism(self) -> bool:
        return self.options.exit_layers[0] < self.model.plan.num_layers

    def draft_depth(self, num_layers: int) -> int:
        return max(self.segment_ends(num_layers))

    def build_draft(self, num_layers: int) -> nn.Module:
        adapter = adapter_for(self.target_model)
        ends = self.segment_ends(num_layers)
        # An end without a trained transform exits through the model's own
        # final norm and head (the last layer's is the full-depth draft).
        transforms: dict[int, torch.Tensor | None] = dict.fromkeys(ends)
        if self.options.trained_heads is not None:
            heads = ExitHeads.open(self.options.trained_heads)
            decoder = adapter.decoder(self.target_model)
            hf_config = self.vllm_config.model_config.hf_config
            heads.check_identity(model_identity(hf_config, decoder.norm.weight))
            transforms.update(heads.transforms(self.options.exit_layers))
        segments, start = [], 0
        for end in ends:
            with (set_model_tag(f"selfspec_exit_{end}"),
                  draft_compile_config(self.vllm_config,
                                       self.draft_weights.layers[start:end]) as config):
                segment = ExitSegment(
                    vllm_config=config, target=self.target_model,
                    adapter=adapter, layers=self.draft_weights.layers, start=start, end=end,
                    transform=transforms[end])
            key_compile_cache(segment, f"exit_{start}_{end}")
            segments.append(segment)
            start = end
        return ExitDraft(segments, self.draft_weights.compute_logits, num_layers)
