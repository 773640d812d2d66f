"""Draft & Verify (Zhang et al., ACL 2024): a static attention/MLP skip set and
an adaptive, per-request draft-exit threshold.

A request stops drafting after a token whose top-1 probability is below its
threshold gamma. After each verification, gamma moves toward the value that
keeps the request's smoothed acceptance rate at `target_acceptance`:
AR <- b1*AR + (1-b1)*AR_round;  g~ = g + eps if AR <= alpha else g - eps;
g <- b2*g + (1-b2)*g~  (the first round sets AR = AR_round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from vllm.config.utils import config

from vllm_selfspec.config import (
    SelfSpecConfig,
    SelfSpecConfigError,
    check_layer_indices,
)
from vllm_selfspec.draft.model import LayerPlan
from vllm_selfspec.draft.tokens import top1_probability
from vllm_selfspec.proposers.base import SelfSpecProposer


@config
class DraftVerifyConfig(SelfSpecConfig):
    method: Literal["draft_verify"] = "draft_verify"
    attn_skip: list[int] | None = None
    """Layers whose attention sub-block the draft skips."""
    mlp_skip: list[int] | None = None
    """Layers whose MLP sub-block the draft skips."""
    threshold: float | None = None
    """The initial draft-exit threshold gamma_0: a request stops drafting
    after a token whose top-1 probability is below gamma."""
    adaptive_threshold: bool | None = None
    """Adapt gamma per request after every verification, toward
    target_acceptance."""
    target_acceptance: float | None = None
    """alpha, the acceptance rate the adaptive threshold steers toward."""
    threshold_step: float | None = None
    """epsilon, the step of the threshold update."""
    acceptance_smoothing: float | None = None
    """beta_1, the smoothing of the acceptance rate."""
    threshold_smoothing: float | None = None
    """beta_2, the smoothing of the threshold."""

    default_num_speculative_tokens = 12
    defaults = {
        "attn_skip": [], "mlp_skip": [], "threshold": 0.6, "adaptive_threshold": True,
        "target_acceptance": 0.9, "threshold_step": 0.01, "acceptance_smoothing": 0.5,
        "threshold_smoothing": 0.9,
    }

    def validate_method_fields(self) -> None:
        for name in ("threshold", "target_acceptance", "acceptance_smoothing",
                     "threshold_smoothing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SelfSpecConfigError(
                    f"speculative_config.{name}: {getattr(self, name)} is outside "
                    "[0, 1]; give a probability."
                )
        if not 0.0 <= self.threshold_step <= 1.0:
            raise SelfSpecConfigError(
                f"speculative_config.threshold_step: {self.threshold_step} is outside "
                "[0, 1]; the reference uses 0.01."
            )

    def validate_for_model(self, num_layers: int) -> None:
        check_layer_indices("attn_skip", self.attn_skip, num_layers)
        check_layer_indices("mlp_skip", self.mlp_skip, num_layers)
        if len(self.attn_skip) == num_layers and len(self.mlp_skip) == num_layers:
            raise SelfSpecConfigError(
                "speculative_config.attn_skip/mlp_skip: every sub-block is skipped, "
                "so the draft would ignore the context; keep at least one layer."
            )

    def method_hash_factors(self) -> list:
        return [sorted(self.attn_skip), sorted(self.mlp_skip)]


@dataclass
class ExitThreshold:
    """One request's adaptive draft-exit threshold and smoothed acceptance."""

    gamma: float
    acceptance: float | None = None

    def update(self, round_acceptance: float, options: DraftVerifyConfig) -> None:
        if self.acceptance is None:
            self.acceptance = round_acceptance
        else:
            beta1 = options.acceptance_smoothing
            self.acceptance = beta1 * self.acceptance + (1 - beta1) * round_acceptance
        step = options.threshold_step
        moved = self.gamma + step if self.acceptance <= options.target_acceptance else (
            self.gamma - step
        )
        beta2 = options.threshold_smoothing
        self.gamma = beta2 * self.gamma + (1 - beta2) * moved


class DraftVerifyProposer(SelfSpecProposer):
    options: DraftVerifyConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.thresholds: dict[str, ExitThreshold] = {}

    def layer_plan(self, num_layers: int) -> LayerPlan:
        return LayerPlan.skipping(num_layers, self.options.attn_skip, self.options.mlp_skip)

    def _threshold(self, req_id: str) -> ExitThreshold:
        if req_id not in self.thresholds:
            self.thresholds[req_id] = ExitThreshold(self.options.threshold)
        return self.thresholds[req_id]

    def observe_round(self, req_id: str, accepted: int, drafted: int) -> None:
        if self.options.adaptive_threshold:
            self._threshold(req_id).update(accepted / drafted, self.options)

    def stop_after(
        self, req_ids: list[str], logits: torch.Tensor, step: int
    ) -> torch.Tensor | None:
        if not self.options.adaptive_threshold and self.options.threshold == 0.0:
            return None  # a fixed zero threshold never stops a draft
        confidence = top1_probability(logits)
        if step == 0:  # thresholds change only between rounds
            self._round_gammas = torch.tensor(
                [self._threshold(req_id).gamma for req_id in req_ids],
                dtype=confidence.dtype, device=confidence.device,
            )
        return confidence < self._round_gammas

    def forget_finished(self, live_req_ids: set[str]) -> None:
        for req_id in set(self.thresholds) - live_req_ids:
            del self.thresholds[req_id]

    def per_request_state(self) -> dict[str, int]:
        return {**super().per_request_state(), "thresholds": len(self.thresholds)}


CONFIG_CLASS = DraftVerifyConfig
PROPOSER_CLASS = DraftVerifyProposer
