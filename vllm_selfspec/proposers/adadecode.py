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

from typing import Literal

import torch
from vllm.config.utils import config

from vllm_selfspec.config import SelfSpecConfigError
from vllm_selfspec.draft.tokens import top1_probability
from vllm_selfspec.proposers.draft_metadata import window_metadata
from vllm_selfspec.proposers.early_exit import EarlyExitConfig, EarlyExitProposer


@config
class AdaDecodeConfig(EarlyExitConfig):
    method: Literal["adadecode"] = "adadecode"
    heads: str | None = None
    """Trained exit heads: a directory with heads.json and heads.safetensors
    (a path, or a name under `vllm_selfspec/configs/heads/`), checked at
    start-up against the model's shapes and weights (final-norm hash). Default:
    the heads shipped for this model, found by its weights
    (`<model>-adadecode` before `<model>`); where none are shipped, start-up
    fails naming the command that trains them."""
    threshold: float | None = None
    """A token is emitted at the first head whose top-1 probability exceeds
    this; above 1 nothing exits early (plain decoding)."""
    max_early: int | None = None
    """The most early predictions outstanding: num_speculative_tokens, under
    the paper's name. Default: num_speculative_tokens's."""

    default_num_speculative_tokens = 5
    defaults = {"threshold": 0.75}

    def validate_method_fields(self) -> None:
        self.validate_heads_field()
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

    def method_hash_factors(self) -> list:
        return [self.heads, self.exit_layers]


class AdaDecodeProposer(EarlyExitProposer):
    options: AdaDecodeConfig

    def draft_step(self, round_tokens, positions, cad, step, drafting):
        batch_size, width = round_tokens.shape
        window_cad, window_positions = window_metadata(cad, positions, width, self.arange,
                                                       self.token_arange_np, self.block_size)
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            window_cad, draft_index=step)
        slots = {name: window_cad.slot_mapping for name in self._draft_attn_layer_names}
        input_ids = round_tokens.reshape(-1).to(torch.int32)
        newest = torch.arange(width - 1, batch_size * width, width, device=self.device)
        exited = ~drafting  # requests that stopped need no deeper layers
        chosen = None
        hidden_states = residual = None
        with self.draft_forward_context(per_layer_metadata, batch_size * width, slots):
            for segment in self.model.segments:
                hidden_states, residual, head_input = segment(
                    input_ids, window_positions, hidden_states, residual)
                logits = self.model.compute_logits(head_input[newest])
                confident = top1_probability(logits) > self.options.threshold
                take = confident & ~exited
                chosen = logits if chosen is None else torch.where(
                    take.view(-1, 1), logits, chosen)
                exited |= take
                if bool(exited.all()):
                    break
        self.policy.counters.add_step(segment.end)
        is_draft = exited & drafting
        return chosen, is_draft


CONFIG_CLASS = AdaDecodeConfig
PROPOSER_CLASS = AdaDecodeProposer
