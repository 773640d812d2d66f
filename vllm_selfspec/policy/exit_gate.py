"""Whether each early-exit head pays against the full-depth draft it replaces.

AdaDecode over the cheap base drafts a token at the first head sure of it and
every other token at full depth. An early exit saves the rest of the draft
step's layers for that token but is accepted less often, and a rejected draft
ends the request's round. A head stays open only while that trade gains: with
a round of k drafts whose first is the head's (acceptance a_h, its share d_h of
the model's layers) and the rest full depth (acceptance a_b),

    T_h = 1 + a_h * E(a_b, k - 1)             C_h = 1 + F + k*c - (1 - d_h)*s
    T_b = 1 + a_b * E(a_b, k - 1)             C_b = 1 + F + k*c

(E: expected tokens of a draft chain, `payoff.expected_tokens`; c, F: the
engine's costs per draft and per round in plain steps; s: a draft step's share
of c), the head is open when T_h / C_h >= T_b / C_b. Acceptances count the
drafts a verification reached (the first rejected draft included, none after
it), each source's own moving average, so a closed head's record waits for its
next trial: one round in `probe_every` opens every closed head again. Inputs
are verified tokens and the costs rank 0 shares, alike on every
tensor-parallel rank, so every rank opens the same heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_selfspec.policy.payoff import StepCosts, expected_tokens

# A draft made at full depth, in a round's list of sources (heads are 0, 1, ...).
BASE = -1


@dataclass
class ExitGate:
    """Per source (each head, then the base), decayed counts of the verified
    drafts reached and of those accepted. `depth_shares`: each head's exit
    layer over the model's layers."""

    depth_shares: Sequence[float]
    decay: float = 0.98
    min_reached: float = 16.0
    probe_every: int = 32
    reached: list[float] = field(init=False)
    accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.reached = [0.0] * (len(self.depth_shares) + 1)  # the base last
        self.accepted = [0.0] * (len(self.depth_shares) + 1)

    def record(self, sources: Sequence[int], accepted: int) -> None:
        """One request's verified drafts, in order, each by the head that made
        it (or BASE), of which the first `accepted` were accepted."""
        for position, source in enumerate(sources[:accepted + 1]):
            self.reached[source] = self.decay * self.reached[source] + 1.0
            self.accepted[source] = (self.decay * self.accepted[source]
                                     + float(position < accepted))

    def acceptance(self, source: int) -> float | None:
        """A source's acceptance, once it has been reached often enough."""
        if self.reached[source] < self.min_reached:
            return None
        return self.accepted[source] / self.reached[source]

    def open_heads(self, costs: StepCosts | None, draft_step_cost: float,
                   max_drafts: int, round_index: int) -> list[bool]:
        """Which heads may draft this round. Every head while there is nothing
        to weigh (no costs, too few drafts of the base or of the head) and on
        a probe round; `draft_step_cost`: one draft step's cost in plain steps
        (the part of c an early exit can save)."""
        base = self.acceptance(BASE)
        if costs is None or base is None or round_index % self.probe_every == 0:
            return [True] * len(self.depth_shares)
        tail = expected_tokens(base, max_drafts - 1)
        full_cost = 1.0 + costs.round_overhead + max_drafts * costs.per_draft
        full_speed = (1.0 + base * tail) / full_cost
        step = min(draft_step_cost, costs.per_draft)
        opened = []
        for head, share in enumerate(self.depth_shares):
            ours = self.acceptance(head)
            opened.append(ours is None or (1.0 + ours * tail) / (
                full_cost - (1.0 - share) * step) >= full_speed)
        return opened

    def describe(self) -> dict:
        return {"acceptance": [None if (a := self.acceptance(s)) is None else round(a, 3)
                               for s in [*range(len(self.depth_shares)), BASE]],
                "reached": [round(n, 1) for n in self.reached]}
