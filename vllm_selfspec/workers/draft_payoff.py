"""Whether drafting pays, per request and round: the cost-aware draft budget.

A round that drafts k tokens costs k draft steps (each c plain steps) and a
verification over k + 1 tokens (1 + k v plain steps), and yields on average
E(k) = 1 + a + ... + a^k tokens when each draft is accepted with probability a
(given the one before was). Plain decoding yields 1 token per plain step, so
drafting k pays when E(k) / (1 + k (c + v)) > 1. The budget is the k in
0..K that maximises that ratio, and 0 unless it beats 1 by `margin`.

`a` is the request's own: decayed counts of accepted drafts and of rounds that
ended in a rejection, a / (1 - a) being accepted drafts per rejection, with a
prior worth two rounds. A request whose budget is 0 drafts nothing, which also
means its estimate stops moving; on every `probe_every`-th round of the engine
it drafts one token anyway, so it starts again when its text turns
predictable. Probes share the engine's round clock, so all idle requests
probe in the same round and one draft forward serves them all.

c and v are measured once per engine (`StepCosts`) and every input here is the
same on every tensor-parallel rank, so every rank decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """A draft step's cost and a verification's extra cost per draft token,
    both in plain decode steps."""

    draft: float
    verify_per_token: float


@dataclass
class DraftPayoff:
    """One request's acceptance record."""

    accepted: float = 0.0
    rejections: float = 0.0

    def update(self, accepted: int, verified: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.rejections = decay * self.rejections + (1.0 if accepted < verified else 0.0)

    def acceptance(self, prior: float, prior_weight: float = 2.0) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), smoothed."""
        accepted = self.accepted + prior * prior_weight
        return accepted / (accepted + self.rejections + (1 - prior) * prior_weight)


def expected_tokens(acceptance: float, drafts: int) -> float:
    """E(k): tokens a round of k chained drafts yields, the bonus included."""
    return sum(acceptance ** i for i in range(drafts + 1))


def best_budget(acceptance: float, costs: StepCosts, max_drafts: int,
                margin: float) -> int:
    """The k in 0..max_drafts with the highest tokens per plain step, or 0
    when no k beats plain decoding by `margin`."""
    best, best_speed = 0, 1.0 + margin
    for drafts in range(1, max_drafts + 1):
        cost = 1.0 + drafts * (costs.draft + costs.verify_per_token)
        speed = expected_tokens(acceptance, drafts) / cost
        if speed > best_speed:
            best, best_speed = drafts, speed
    return best


def round_budget(payoff: DraftPayoff, costs: StepCosts, max_drafts: int, prior: float,
                 margin: float, probe: bool) -> int:
    """This round's budget for one request: 1 instead of 0 on a probe round."""
    budget = best_budget(payoff.acceptance(prior), costs, max_drafts, margin)
    return 1 if budget == 0 and probe else budget
