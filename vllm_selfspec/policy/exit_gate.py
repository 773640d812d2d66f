"""Whether each early-exit head pays against the full-depth draft it replaces.

AdaDecode over the cheap base drafts a token at the first head sure of it and
every other token at full depth. An early exit saves the rest of the draft
step's layers for that token but may be accepted less often, and a rejected
draft ends the request's round. A head stays open only while that trade gains:
with a round of k drafts (the rounds' measured mean length: the base's
confidence stop ends most before the most a round may have) whose first is the
head's (acceptance a_h, its share d_h of the model's layers) and the rest full
depth (acceptance a_b),

    T_h = 1 + a_h * E(a_b, k - 1)             C_h = 1 + F + k*c - (1 - d_h)*s
    T_b = 1 + a_bh * E(a_b, k - 1)            C_b = 1 + F + k*c

(E: expected tokens of a draft chain, `payoff.expected_tokens`; c, F: the
engine's costs per draft and per round in plain steps; s: a draft step's part
of c, the verification's share taken off), the head is open when
T_h / C_h beats T_b / C_b by cost-aware drafting's margin (`MIN_GAIN`: the
costs leave out what an open head adds, its LM-head pass and the window of
deferred rows each later step recomputes). a_bh is the full-depth draft's
acceptance on the tokens head h is sure of (easier than the average token):
measured on shadow rounds,
which compute every head's confidence but draft at full depth. At a batch of
more than one request a draft step stops early only when every row has
exited, so there an exit is credited no saving and a head stays open only if
it is accepted as often as the full-depth draft.

Acceptances count the drafts a verification reached (the first rejected draft
included, none after it), a moving average per source, so a closed head's
record waits for its next trial: in every `probe_every` drafting rounds one
opens every head and one is a shadow round. Between those, until the base has
a record every head is closed, and a head with none opens one round in
`measure_every`. A round
with a head open to be measured rather than because it pays (a probe, or a
head with no record) is a trial: its outcome teaches the gate, not the
requests' acceptance records, so the rounds that measure the heads never hold
the requests' own records back (were every round a trial, those records would
stay at the prior, and requests would decline to draft). Inputs are verified
tokens and the costs rank 0 shares, alike on every tensor-parallel rank, so
every rank opens the same heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_selfspec.policy.payoff import StepCosts, expected_tokens
from vllm_selfspec.policy.rounds import MIN_GAIN

# A draft made at full depth, in a round's list of sources (head h is h, and a
# full-depth draft of a token head h was sure of, on a shadow round, is
# `ExitGate.shadowed(h)`).
BASE = -1


@dataclass(frozen=True)
class GateRound:
    """A drafting round's heads: which may draft, whether this is a shadow
    round (every head's confidence computed, every token drafted at full
    depth), and whether it is a trial."""

    open: list[bool]
    shadow: bool = False
    # A head is open to be measured, not because it pays (a probe round, or a
    # head with no record yet): the round's outcome is not what the method's
    # steady drafts accept (`RoundPolicy.note_trials`).
    trial: bool = False


@dataclass
class ExitGate:
    """Decayed counts of the verified drafts reached and accepted per source:
    each head, the base where each head was sure, the base. `depth_shares`:
    each head's exit layer over the model's layers."""

    depth_shares: Sequence[float]
    decay: float = 0.98
    min_reached: float = 16.0
    probe_every: int = 32
    # A round measuring unmeasured heads drafts with them before they are
    # known to pay, so such rounds come one in `measure_every`: a small share
    # of the rounds, as probes are.
    measure_every: int = 16
    rounds: int = 0
    reached: list[float] = field(init=False)
    accepted: list[float] = field(init=False)
    # Decayed sums of the drafts verified per request-round and of those
    # rounds: the rounds' mean length, which the confidence stop keeps below
    # the most drafts a round may have.
    drafted: float = 0.0
    request_rounds: float = 0.0

    def __post_init__(self) -> None:
        if self.min_reached <= 0 or self.probe_every < 2 or self.measure_every < 1:
            raise ValueError("ExitGate: min_reached must be > 0, probe_every >= 2 and "
                             "measure_every >= 1")
        sources = 2 * len(self.depth_shares) + 1  # heads, shadowed heads, the base last
        self.reached = [0.0] * sources
        self.accepted = [0.0] * sources

    def shadowed(self, head: int) -> int:
        """The source of a full-depth draft of a token `head` was sure of."""
        return len(self.depth_shares) + head

    def record(self, sources: Sequence[int], accepted: int) -> None:
        """One request's verified drafts, in order, each by its source, of
        which the first `accepted` were accepted."""
        self.drafted = self.decay * self.drafted + len(sources)
        self.request_rounds = self.decay * self.request_rounds + 1.0
        for position, source in enumerate(sources[:accepted + 1]):
            self.reached[source] = self.decay * self.reached[source] + 1.0
            self.accepted[source] = (self.decay * self.accepted[source]
                                     + float(position < accepted))

    def acceptance(self, source: int) -> float | None:
        """A source's acceptance, once it has been reached often enough."""
        if self.reached[source] < self.min_reached:
            return None
        return self.accepted[source] / self.reached[source]

    def round_length(self, max_drafts: int) -> int:
        """The drafts of a round as the rounds have run (`max_drafts` before
        any was recorded)."""
        if self.request_rounds < 1.0:
            return max_drafts
        return min(max_drafts, max(1, round(self.drafted / self.request_rounds)))

    def next_round(self, costs: StepCosts | None, batch_size: int,
                   max_drafts: int) -> GateRound:
        """The heads of the next drafting round at these costs (None: not
        cost-aware, every head drafts), for rounds of at most `max_drafts`."""
        self.rounds += 1
        every, closed = [True] * len(self.depth_shares), [False] * len(self.depth_shares)
        base = self.acceptance(BASE)
        if costs is None:
            return GateRound(every)
        if self.rounds % self.probe_every == 0:
            return GateRound(every, trial=True)
        if self.rounds % self.probe_every == self.probe_every // 2:
            return GateRound(closed, shadow=True)
        if base is None:
            return GateRound(closed)  # the base drafts alone until it has a record
        measuring = self.rounds % self.measure_every == 0
        drafts = self.round_length(max_drafts)
        tail = expected_tokens(base, drafts - 1)
        full_cost = 1.0 + costs.round_overhead + drafts * costs.per_draft
        step = max(0.0, costs.per_draft - batch_size * (costs.per_verified or 0.0))
        opened, measured_now = [], False
        for head, share in enumerate(self.depth_shares):
            ours = self.acceptance(head)
            if ours is None:  # open to be measured, one round in measure_every
                opened.append(measuring)
                measured_now |= measuring
                continue
            theirs = self.acceptance(self.shadowed(head))
            theirs = base if theirs is None else theirs
            saving = (1.0 - share) * step if batch_size == 1 else 0.0
            opened.append((1.0 + ours * tail) / (full_cost - saving)
                          > (1.0 + MIN_GAIN) * (1.0 + theirs * tail) / full_cost)
        return GateRound(opened, trial=measured_now)

    def describe(self) -> dict:
        heads = range(len(self.depth_shares))

        def rounded(source: int) -> float | None:
            value = self.acceptance(source)
            return None if value is None else round(value, 3)

        return {"head_acceptance": [rounded(h) for h in heads],
                "base_acceptance_where_sure": [rounded(self.shadowed(h)) for h in heads],
                "base_acceptance": rounded(BASE),
                "reached": [round(n, 1) for n in self.reached]}
