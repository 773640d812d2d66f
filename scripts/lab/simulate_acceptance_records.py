"""Simulate cost-aware drafting's acceptance records on requests of known acceptance.

The engine decides each round from a request's decayed acceptance record
(policy/payoff.py). How fast a record forgets is a trade: short memory
follows text that changes, but its noise can stop a request that should draft,
and a request that drafts nothing gets no feedback to start again. This runs
the plugin's own `AcceptanceRecords` and budget rules at batch 1 on synthetic
requests whose every position has a known chance that a draft of it is
accepted, and reports tokens per plain step against an oracle that knows those
chances. Costs are in plain steps: 0.6 per draft token is what the engine timed
for Qwen2.5-Coder-1.5B's int8 draft with the reduced head (docs/results/methods.md).

    python scripts/lab/simulate_acceptance_records.py
"""

from __future__ import annotations

import argparse
import random

from vllm_selfspec.policy.payoff import (
    AcceptanceRecords,
    StepCosts,
    best_budget,
    probe_interval,
)
from vllm_selfspec.policy.rounds import (
    ENGINE_PAYOFF_DECAY,
    IDLE_DECAY,
    MIN_GAIN,
    PAYOFF_DECAY,
    PRIOR_ACCEPTANCE,
    PROBE_SHARE,
)

MAX_DRAFTS = 12
# name: (decay, engine decay, idle decay); idle decay 1.0 never forgets
SETTINGS = {"before (0.8, 0.8, none)": (0.8, 0.8, 1.0),
            "now": (PAYOFF_DECAY, ENGINE_PAYOFF_DECAY, IDLE_DECAY)}
# name: per-request chance sequences, (easy, hard, chance to stay in a state);
# "alternating" requests take the first pair for odd requests, the second for even
TEXTS = {"stationary 0.9": (0.9, 0.9, 1.0), "stationary 0.95": (0.95, 0.95, 1.0),
         "stationary 0.7": (0.7, 0.7, 1.0), "spans 0.97 / 0.5": (0.97, 0.5, 0.95),
         "spans 0.95 / 0.3": (0.95, 0.3, 0.9), "never 0.1": (0.1, 0.1, 1.0)}


def make_text(length: int, easy: float, hard: float, stay: float,
              rng: random.Random) -> list[float]:
    """Each position's chance that a draft of it is accepted."""
    chances, in_easy = [], True
    for _ in range(length):
        chances.append(easy if in_easy else hard)
        if rng.random() > stay:
            in_easy = not in_easy
    return chances


def accepted_drafts(chances: list[float], position: int, drafts: int,
                    rng: random.Random) -> int:
    accepted = 0
    while (accepted < drafts and position + 1 + accepted < len(chances)
           and rng.random() < chances[position + accepted]):
        accepted += 1
    return accepted


def round_cost(costs: StepCosts, drafts: int) -> float:
    """A round's plain steps: 1 without drafts, 1 + F + k w with k."""
    return 1.0 + (costs.round_overhead + drafts * costs.per_draft if drafts else 0.0)


def simulate(texts: list[list[float]], costs: StepCosts, setting: tuple[float, float, float],
             seed: int) -> tuple[float, float]:
    """Tokens per plain step and the share of rounds that drafted nothing."""
    rng = random.Random(seed)
    decay, engine_decay, idle_decay = setting
    records = AcceptanceRecords(PRIOR_ACCEPTANCE, decay, engine_decay, idle_decay)
    interval = probe_interval(costs, 16, PROBE_SHARE)
    steps = tokens = 0.0
    rounds = declined = 0
    for index, chances in enumerate(texts):
        req_id, position = str(index), 0
        while position < len(chances):
            rounds += 1
            budget = records.budgets([req_id], costs, MAX_DRAFTS, MIN_GAIN,
                                     rounds % interval == 0, rounds)[0][0]
            accepted = accepted_drafts(chances, position, budget, rng)
            if budget:
                # Feedback comes in the next round, as in the engine.
                records.add_request_round(req_id, accepted, budget, rounds + 1)
                records.add_engine_round(accepted, int(accepted < budget))
            else:
                declined += 1
            steps += round_cost(costs, budget)
            tokens += accepted + 1
            position += accepted + 1
        records.forget(set())
    return tokens / steps, declined / rounds


def oracle(texts: list[list[float]], costs: StepCosts, seed: int) -> float:
    """Tokens per plain step when each round's budget knows the chance at its position."""
    rng = random.Random(seed)
    steps = tokens = 0.0
    for chances in texts:
        position = 0
        while position < len(chances):
            budget = best_budget(chances[position], costs, MAX_DRAFTS, 0.0)
            accepted = accepted_drafts(chances, position, budget, rng)
            steps += round_cost(costs, budget)
            tokens += accepted + 1
            position += accepted + 1
    return tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--per-draft", type=lambda v: [float(x) for x in v.split(",")],
                        default=[0.6, 0.3], help="draft token costs in plain steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    cases = {name: [make_text(args.tokens, *shape, rng) for _ in range(args.requests)]
             for name, shape in TEXTS.items()}
    cases["alternating 0.95 / 0.2 requests"] = [
        make_text(args.tokens, *((0.95, 0.95, 1.0) if i % 2 else (0.2, 0.2, 1.0)), rng)
        for i in range(args.requests)]
    print(f"tokens per plain step (share of rounds declined), batch 1, {args.requests} "
          f"requests x {args.tokens} tokens, up to {MAX_DRAFTS} drafts")
    print("| text | cost per draft | oracle | " + " | ".join(SETTINGS) + " |")
    print("|---|---|---|" + "---|" * len(SETTINGS))
    for name, texts in cases.items():
        for per_draft in args.per_draft:
            costs = StepCosts(per_draft=per_draft)
            cells = [f"{speed:.3f} ({share:.0%})" for speed, share in
                     (simulate(texts, costs, setting, args.seed) for setting in SETTINGS.values())]
            print(f"| {name} | {per_draft} | {oracle(texts, costs, args.seed):.3f} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
