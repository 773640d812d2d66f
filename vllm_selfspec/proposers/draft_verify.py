"""Draft & Verify (Zhang et al., ACL 2024): a static attention/MLP skip set and
an adaptive, per-request draft-exit threshold (`policy/confidence_stop.py`):
a request stops drafting after a token whose top-1 probability is below its
threshold gamma, and gamma moves after each verification toward the value that
keeps the request's smoothed acceptance rate at `target_acceptance`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from vllm.config.utils import config

from vllm_selfspec.config import Option, SelfSpecConfigError, check_layer_indices
from vllm_selfspec.draft.choice import DraftChoiceConfig
from vllm_selfspec.draft.plan import LayerPlan
from vllm_selfspec.policy.confidence_stop import (
    REFERENCE_MAX_DRAFTS,
    REFERENCE_RULE,
    ConfidenceStop,
)
from vllm_selfspec.proposers.base import SelfSpecProposer


@config
class DraftVerifyConfig(DraftChoiceConfig):
    method: Literal["draft_verify"] = "draft_verify"
    attn_skip: Annotated[list[int] | None, Option([])] = None
    """Layers whose attention sub-block the draft skips."""
    mlp_skip: Annotated[list[int] | None, Option([])] = None
    """Layers whose MLP sub-block the draft skips."""
    threshold: Annotated[float | None, Option(REFERENCE_RULE.threshold, ge=0, le=1)] = None
    """The initial draft-exit threshold gamma_0: a request stops drafting
    after a token whose top-1 probability is below gamma."""
    adaptive_threshold: Annotated[bool | None, Option(REFERENCE_RULE.adaptive_threshold)] = None
    """Adapt gamma per request after every verification, toward
    target_acceptance."""
    target_acceptance: Annotated[
        float | None, Option(REFERENCE_RULE.target_acceptance, ge=0, le=1)] = None
    """alpha, the acceptance rate the adaptive threshold steers toward."""
    threshold_step: Annotated[
        float | None, Option(REFERENCE_RULE.threshold_step, ge=0, le=1)] = None
    """epsilon, the step of the threshold update."""
    acceptance_smoothing: Annotated[
        float | None, Option(REFERENCE_RULE.acceptance_smoothing, ge=0, le=1)] = None
    """beta_1, the smoothing of the acceptance rate."""
    threshold_smoothing: Annotated[
        float | None, Option(REFERENCE_RULE.threshold_smoothing, ge=0, le=1)] = None
    """beta_2, the smoothing of the threshold."""

    default_num_speculative_tokens = REFERENCE_MAX_DRAFTS

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


class DraftVerifyProposer(SelfSpecProposer):
    options: DraftVerifyConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.confidence_stop = ConfidenceStop(self.options)

    def layer_plan(self, num_layers: int) -> LayerPlan:
        return LayerPlan.skipping(num_layers, self.options.attn_skip, self.options.mlp_skip)

    def observe_round(self, req_id: str, accepted: int, drafted: int) -> None:
        self.confidence_stop.observe(req_id, accepted, drafted)

    def stop_after(
        self, req_ids: list[str], logits: torch.Tensor, step: int
    ) -> torch.Tensor | None:
        return self.stop_below_threshold(self.confidence_stop, req_ids, logits, step)

    def forget_finished(self, live_req_ids: set[str]) -> None:
        self.confidence_stop.forget(live_req_ids)

    def per_request_state(self) -> dict[str, int]:
        return {**super().per_request_state(), "thresholds": len(self.confidence_stop)}


CONFIG_CLASS = DraftVerifyConfig
PROPOSER_CLASS = DraftVerifyProposer
