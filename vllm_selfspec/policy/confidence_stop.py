"""Draft & Verify's adaptive draft-exit threshold, per request: a request
stops drafting after a token whose top-1 probability is below its threshold
gamma, and after each verification gamma moves toward the value that keeps
the request's smoothed acceptance at the target:

    AR <- b1*AR + (1-b1)*AR_round;  g~ = g + eps if AR <= alpha else g - eps;
    g <- b2*g + (1-b2)*g~            (the first round sets AR = AR_round)

`draft_verify` stops its drafts this way, and so does AdaDecode's full-depth
base, so that with every exit head closed its rounds are the base's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class ThresholdOptions(Protocol):
    """The rule's values, read every round (draft_verify's options, which an
    RPC may change while serving, or a fixed `ThresholdRule`)."""

    threshold: float
    adaptive_threshold: bool
    target_acceptance: float
    threshold_step: float
    acceptance_smoothing: float
    threshold_smoothing: float


@dataclass(frozen=True)
class ThresholdRule:
    """The threshold's start and its update (Draft & Verify's names)."""

    threshold: float = 0.6  # gamma_0
    adaptive_threshold: bool = True
    target_acceptance: float = 0.9  # alpha
    threshold_step: float = 0.01  # epsilon
    acceptance_smoothing: float = 0.5  # beta_1
    threshold_smoothing: float = 0.9  # beta_2


# The reference implementation's values, draft_verify's defaults: the rule,
# and K, the most drafts of a round it stops.
REFERENCE_RULE = ThresholdRule()
REFERENCE_MAX_DRAFTS = 12


@dataclass
class ExitThreshold:
    """One request's threshold and smoothed acceptance."""

    gamma: float
    acceptance: float | None = None

    def update(self, round_acceptance: float, rule: ThresholdOptions) -> None:
        if self.acceptance is None:
            self.acceptance = round_acceptance
        else:
            beta1 = rule.acceptance_smoothing
            self.acceptance = beta1 * self.acceptance + (1 - beta1) * round_acceptance
        step = rule.threshold_step
        moved = self.gamma + step if self.acceptance <= rule.target_acceptance else (
            self.gamma - step)
        beta2 = rule.threshold_smoothing
        self.gamma = beta2 * self.gamma + (1 - beta2) * moved


@dataclass
class ConfidenceStop:
    """Every live request's threshold (bounded by the requests vLLM holds:
    `forget` drops the rest). Without `adaptive_threshold` every request takes
    the rule's threshold as it is now."""

    rule: ThresholdOptions
    requests: dict[str, ExitThreshold] = field(default_factory=dict)

    def gammas(self, req_ids: list[str]) -> list[float]:
        """Each request's threshold this round (they change only between
        rounds); without `adaptive_threshold`, the rule's threshold as it is
        now, for every request."""
        if not self.rule.adaptive_threshold:
            return [self.rule.threshold] * len(req_ids)
        return [self._threshold(req_id).gamma for req_id in req_ids]

    def observe(self, req_id: str, accepted: int, drafted: int) -> None:
        """A verified round of the request's drafts, `drafted` > 0 of them."""
        if self.rule.adaptive_threshold and drafted > 0:
            self._threshold(req_id).update(accepted / drafted, self.rule)

    def never_stops(self) -> bool:
        """A fixed threshold of zero: no confidence is below it."""
        return not self.rule.adaptive_threshold and self.rule.threshold == 0.0

    def forget(self, live_req_ids: set[str]) -> None:
        for req_id in set(self.requests) - live_req_ids:
            del self.requests[req_id]

    def __len__(self) -> int:
        return len(self.requests)

    def _threshold(self, req_id: str) -> ExitThreshold:
        if req_id not in self.requests:
            self.requests[req_id] = ExitThreshold(self.rule.threshold)
        return self.requests[req_id]
