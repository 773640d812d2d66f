"""AdaDecode (Wei et al., ICML 2025): adaptive-depth early prediction with
trained exit heads, verified losslessly.

Each draft token runs the target's layers segment by segment and is emitted at
the first exit head whose top-1 probability exceeds `threshold`; a token no
head is sure of ends the request's drafts, and the verification forward (all
layers) produces it, as AdaDecode's last layer does. At most `max_early`
early tokens are outstanding: that is the round length.

The deeper layers of an early token are deferred, not dropped: the next draft
step's query holds the whole round so far (the sampled token and every earlier
draft) beside the new token, so when the new token reaches a layer, the
earlier tokens' KV at that layer is computed in the same batched forward, in
the target's paged cache. Unlike AdaDecode, which carries each deferred token's
hidden state, the window restarts from layer 0: it recomputes a few shallow
rows instead of keeping per-token state, and costs no extra sequential steps.
The verification forward completes every layer for all drafts at once.

Drafts are head argmaxes passed without probabilities, so vLLM's rejection
sampler accepts draft x with probability p_target(x) and resamples from the
renormalised remainder: the target distribution is kept at any temperature
(the paper's min(1, p*/p_i) rule with a one-hot p_i).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
from vllm.compilation.backends import set_model_tag
from vllm.config.utils import config
from vllm.forward_context import set_forward_context

from vllm_selfspec.config import CONFIGS_DIR, SelfSpecConfig, SelfSpecConfigError
from vllm_selfspec.models import adapter_for
from vllm_selfspec.proposers.base import SelfSpecProposer
from vllm_selfspec.workers.exit_heads import (
    ExitDraft,
    ExitHeads,
    ExitSegment,
    HeadsFileError,
    model_identity,
)


@config
class AdaDecodeConfig(SelfSpecConfig):
    method: Literal["adadecode"] = "adadecode"
    heads: str | None = None
    """Directory of trained exit heads (heads.json + heads.safetensors), a path
    or a name under configs/heads/."""
    threshold: float | None = None
    """Emit a token at the first head whose top-1 probability exceeds this
    (default 0.75; above 1 nothing exits early)."""
    exit_layers: list[int] | None = None
    """Which of the heads' exit layers to use (default: all)."""
    max_early: int | None = None
    """Most early predictions outstanding, i.e. num_speculative_tokens (default 5)."""

    default_num_speculative_tokens = 5
    own_fields = ("heads", "threshold", "exit_layers", "max_early")

    def validate_method_fields(self) -> None:
        if self.heads is None:
            raise SelfSpecConfigError(
                "speculative_config.heads: adadecode needs trained exit heads; train "
                "them with scripts/train_exit_heads.py and give their directory."
            )
        self.heads = str(resolve_heads(self.heads))
        if self.threshold is None:
            self.threshold = 0.75
        if self.threshold < 0:
            raise SelfSpecConfigError(
                f"speculative_config.threshold: {self.threshold} is negative; give a "
                "probability such as 0.75 (above 1 disables early exits)."
            )
        if self.max_early is not None:
            if self.max_early < 1:
                raise SelfSpecConfigError(
                    f"speculative_config.max_early: {self.max_early} must be >= 1.")
            self.num_speculative_tokens = self.max_early
        self.max_early = self.num_speculative_tokens

    def validate_for_model(self, num_layers: int) -> None:
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

    def method_hash_factors(self) -> list:
        return [self.heads, self.exit_layers]


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


def local_final_norm(model: str) -> torch.Tensor | None:
    """The final norm's weight, read from a local checkpoint (None if remote)."""
    from safetensors import safe_open

    for file in sorted(Path(model).glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            if "model.norm.weight" in weights.keys():
                return weights.get_tensor("model.norm.weight")
    return None


class AdaDecodeProposer(SelfSpecProposer):
    options: AdaDecodeConfig

    def build_draft(self, num_layers: int) -> nn.Module:
        heads = ExitHeads.open(self.options.heads)
        adapter = adapter_for(self.target_model)
        decoder = adapter.decoder(self.target_model)
        hf_config = self.vllm_config.model_config.hf_config
        heads.check_identity(model_identity(hf_config, decoder.norm.weight))
        transforms = heads.transforms(self.options.exit_layers)
        segments, start = [], 0
        for end in self.options.exit_layers:
            with set_model_tag(f"selfspec_exit_{end}"):
                segments.append(ExitSegment(
                    vllm_config=self.vllm_config, target=self.target_model,
                    adapter=adapter, start=start, end=end, transform=transforms[end]))
            start = end
        return ExitDraft(segments, self.target_model.compute_logits, num_layers)

    def draft_step(self, round_tokens, positions, cad, step, drafting):
        batch_size, width = round_tokens.shape
        window_cad, window_positions = self.window_metadata(cad, positions, width)
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            window_cad, draft_index=step)
        slots = {name: window_cad.slot_mapping for name in self._draft_attn_layer_names}
        input_ids = round_tokens.reshape(-1).to(torch.int32)
        newest = torch.arange(width - 1, batch_size * width, width, device=self.device)
        exited = ~drafting  # requests that stopped need no deeper layers
        chosen = None
        hidden_states = residual = None
        with set_forward_context(per_layer_metadata, self.vllm_config,
                                 num_tokens=batch_size * width, slot_mapping=slots):
            for segment in self.model.segments:
                hidden_states, residual, head_input = segment(
                    input_ids, window_positions, hidden_states, residual)
                logits = self.model.compute_logits(head_input[newest])
                confident = logits.float().softmax(dim=-1).amax(dim=-1) > (
                    self.options.threshold)
                take = confident & ~exited
                chosen = logits if chosen is None else torch.where(
                    take.view(-1, 1), logits, chosen)
                exited |= take
                if bool(exited.all()):
                    break
        is_draft = exited & drafting
        return chosen, is_draft


CONFIG_CLASS = AdaDecodeConfig
PROPOSER_CLASS = AdaDecodeProposer
