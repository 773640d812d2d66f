"""DEL (Zheng et al., 2025): per request, a dynamic exit layer and speculation
length for early-exit drafting, chosen every round to maximise tokens per
loaded layer (the arithmetic is in `policy/exit_stats.py`).

Drafts exit after E layers through the exit head at E: the model's own LM
head (LayerSkip-style models) or trained heads (`heads`, from
scripts/train_exit_heads.py, for vanilla models). Draft KV of layers < E is
exact and lands in the target's paged cache; the verification forward
rewrites every layer there anyway (see docs/design.md for why it does not skip
the layers below E).

Shadow tokens cost no extra forward: the target returns the residual stream
after each candidate exit layer (vLLM's EAGLE-3 auxiliary hidden states), and
one LM-head pass over every candidate layer's head inputs at each request's
valid positions of the forward that just ran (the accepted drafts and the
bonus token; at prefill, the last `stat_positions` prompt positions) tells
which layers would have predicted the tokens that followed, and how
confidently. The candidate layers enter the compile hash: they change the
target's graph.

TPL counts a forward's fixed cost (`step_overhead`, in layers), measured by
default: on a CPU the LM head and the engine's per-step work cost several
layers, and the paper's pure layer count drafts where wall time says not to.

The last layer is a candidate too, as the full-depth draft over the same
weights (`full_depth`): cost-aware, a round drafts at the chosen exits only
where their measured acceptance and step cost beat it, else at full depth as
`draft_verify` at its defaults does (`policy/mechanism_gate.py`). It is weighed
on verified drafts, not in TPL: a shadow token at the last layer is the
target's own, accepted whatever the copy would have drafted.

State is per request and fed only from tokens and gathered logits, which are
identical on every tensor-parallel rank, and the measured overhead is rank
0's on every rank, so every rank makes the same choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from vllm.config.utils import config

from vllm_selfspec.config import Option, SelfSpecConfigError
from vllm_selfspec.draft.tokens import top1, top1_probability
from vllm_selfspec.policy.exit_stats import ExitChoice, ExitStats
from vllm_selfspec.proposers.base import DraftStep, VerifiedTokens
from vllm_selfspec.proposers.early_exit import EarlyExitConfig, EarlyExitProposer

# Timings per exit layer for the measured step_overhead: a few suffice, as the
# fit runs through every exit once, at start-up.
EXIT_TIMING_REPEATS = 5
# Rounds the full-depth base drafts need no exit choice; their statistics are
# updated one round in this many (each update costs an LM-head pass over
# every exit's positions), and in every round the exits draft.
BASE_ROUND_STATS_EVERY = 4


@config
class DelConfig(EarlyExitConfig):
    method: Literal["del"] = "del"
    heads: str | None = None
    """Trained exit heads (a directory, a path or a name under
    `vllm_selfspec/configs/heads/`, checked as AdaDecode's), or "none": the
    model's own LM head at each exit (LayerSkip-trained models need no heads,
    vanilla ones do). Giving exit_layers or exit_layer_stride without heads
    means "none". Default: the heads shipped for this model, found by its
    weights (`<model>-del` before `<model>`), else "none"."""
    exit_layers: list[int] | None = None
    """Candidate exit layers (an exit after E layers); each adds one LM-head
    pass over a round's valid positions. Default: all of the heads' exits, or
    with heads "none" every exit_layer_stride-th layer 1..L-1."""
    exit_layer_stride: Annotated[int | None, Option(ge=1)] = None
    """Without heads: candidate exits every n-th layer, 1..L-1 (bounds the
    shadow-token cost). Default: 1, every layer."""
    decay: Annotated[float | None, Option(0.95, gt=0, le=1)] = None
    """omega, the per-round decay of the statistics."""
    max_draft: Annotated[int | None, Option(ge=1)] = None
    """d_max, the most drafts per round: num_speculative_tokens, under the
    paper's name. Default: num_speculative_tokens's."""
    stat_positions: Annotated[int | None, Option(32, ge=1)] = None
    """Positions per forward that feed the statistics (at prefill, the last
    this-many prompt positions)."""
    step_overhead: Annotated[float | None, Option(ge=0)] = None
    """o, a forward's fixed cost (LM head, sampling, engine) in decoder layers,
    added to every draft step and to the verification in TPL's cost:
    TPL(E, d) = sum a^i / (d(E+o) + L + o); 0 is the paper's layer count.
    Default: measured by the engine at start-up, before any request (a line
    through the time of a draft step at each exit; rank 0's value on every
    rank)."""
    exit_layer: int | None = None
    """Fix the exit layer E (the paper's DEL-gamma ablation). Default: chosen
    every round."""
    draft_length: int | None = None
    """Fix the drafts per round and turn the confidence stop off; with
    exit_layer this is static early-exit drafting, LayerSkip's LS(E-gamma).
    Default: set by the confidence threshold tau."""

    heads_required = False
    default_num_speculative_tokens = 18

    def validate_method_fields(self) -> None:
        self.validate_heads_field()
        if self.exit_layer_stride is not None and (
                self.trained_heads is not None or self.exit_layers is not None):
            raise SelfSpecConfigError(
                "speculative_config.exit_layer_stride: applies only without heads and "
                "exit_layers; remove it or list the exits in exit_layers.")
        if self.max_draft is not None:
            self.num_speculative_tokens = self.max_draft
        self.max_draft = self.num_speculative_tokens
        if self.step_overhead is not None:  # None: measured by the engine
            self.step_overhead = float(self.step_overhead)
        if self.draft_length is not None and not 1 <= self.draft_length <= self.max_draft:
            raise SelfSpecConfigError(
                f"speculative_config.draft_length: {self.draft_length} must be in "
                f"1..max_draft ({self.max_draft}).")

    def wants_shipped_heads(self) -> bool:
        # Exits given by layer or stride use the model's own head there.
        return self.exit_layers is None and self.exit_layer_stride is None

    def default_exit_layers(self, num_layers: int) -> list[int]:
        return list(range(self.exit_layer_stride or 1, num_layers, self.exit_layer_stride or 1))

    def validate_for_model(self, num_layers: int) -> None:
        super().validate_for_model(num_layers)
        if self.exit_layer is not None and self.exit_layer not in self.exit_layers:
            raise SelfSpecConfigError(
                f"speculative_config.exit_layer: {self.exit_layer} is not one of the "
                f"candidate exit layers {self.exit_layers}.")

    def method_hash_factors(self) -> list:
        return [self.heads, self.exit_layers]


@dataclass
class RoundPlan:
    """Every request's choice for this round, on the host and the device."""

    choices: list[ExitChoice]
    thresholds: torch.Tensor
    max_drafts: torch.Tensor

    def exit_layers(self) -> list[int]:
        return [choice.exit_layer for choice in self.choices]


class DelProposer(EarlyExitProposer):
    options: DelConfig

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner=runner)
        if runner is not None:
            # The target returns its candidate layers' states for the shadow
            # tokens; which layers: `aux_hidden_state_layers` (see integration/patches.py).
            runner.use_aux_hidden_state_outputs = True
        self.exit_stats: dict[str, ExitStats] = {}
        self.plan: RoundPlan | None = None
        self.trace: dict[str, list[dict]] | None = None  # per round, when enabled
        self.measured_overhead: float | None = None  # rank 0's, timed at start-up
        # Seconds of a draft step exiting at each exit, rank 0's, timed with
        # the overhead.
        self.exit_seconds: dict[int, float] | None = None
        self.full_depth_seconds: float | None = None  # the base's draft step, rank 0's
        # Each request's exit when it last chose to draft (the gate prices a
        # round of the exits by its requests' deepest).
        self.drafting_exits: dict[str, int] = {}
        self.base_rounds = 0

    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return tuple(self.options.exit_layers)

    def draft_depth(self, num_layers: int) -> int:
        """Every layer where the full-depth base drafts (`full_depth`)."""
        return num_layers if self.options.full_depth else super().draft_depth(num_layers)

    # --- statistics -------------------------------------------------------
    def begin_round(self, req_ids: list[str], verified: VerifiedTokens) -> None:
        if self.source is not None and not self.source.mechanism:
            self.base_rounds += 1
            if self.base_rounds % BASE_ROUND_STATS_EVERY:
                return  # a base round: no exit to choose
        counts = self._shadow_counts(verified).cpu().numpy()
        layers = np.asarray(self.options.exit_layers)
        num_layers = self.model.plan.num_layers
        overhead = self.step_overhead()
        choices = []
        for row, req_id in enumerate(req_ids):
            stats = self.exit_stats.get(req_id)
            if stats is None:
                stats = self.exit_stats[req_id] = ExitStats(layers, self.options.decay)
            valid, matched, matched_conf, mismatched_conf = counts[row]
            stats.update(valid[0], matched, matched_conf, mismatched_conf)
            choices.append(stats.choose(num_layers, self.options.max_draft,
                                        self.options.exit_layer, self.options.draft_length,
                                        overhead))
        for req_id, choice in zip(req_ids, choices):
            if choice.max_drafts > 0:
                self.drafting_exits[req_id] = choice.exit_layer
        self.plan = RoundPlan(
            choices,
            torch.tensor([c.threshold for c in choices], device=self.device),
            torch.tensor([c.max_drafts for c in choices], device=self.device),
        )
        if self.trace is not None:
            for req_id, choice in zip(req_ids, choices):
                self.trace.setdefault(req_id, []).append({
                    **vars(choice), "step_overhead": overhead,
                    "acceptance_per_layer": self.exit_stats[req_id].acceptance().tolist()})

    def mechanism_drafts(self) -> bool:
        """Some request's exit pays this round (its TPL chose a length)."""
        return self.plan is not None and any(c.max_drafts > 0 for c in self.plan.choices)

    def time_costs(self) -> None:
        super().time_costs()
        self.step_overhead()

    def timed_at_start_up(self) -> dict:
        return {**super().timed_at_start_up(), "step_overhead_layers": self.measured_overhead}

    def step_overhead(self) -> float:
        """TPL's fixed cost per forward, in layers: the configured one, else
        measured once, at start-up (a line through the draft step's time at
        each exit, proposers/timing.py), on every rank, rank 0's kept by all."""
        if self.options.step_overhead is not None:
            return self.options.step_overhead
        self.time_exits()
        return self.measured_overhead

    def time_exits(self) -> None:
        """Time a draft step at each segment's end, once (every rank runs
        the steps; rank 0's times are kept by all)."""
        if self.exit_seconds is not None:
            return
        from vllm.distributed import get_tp_group

        from vllm_selfspec.proposers.timing import measure_exit_costs

        measured = measure_exit_costs(self.runner, repeats=EXIT_TIMING_REPEATS)
        fitted = measured["step_overhead_layers"]
        # No usable line (one exit at the last layer, or timing noise over
        # exits too close to tell apart): the paper's layer count.
        overhead = fitted if math.isfinite(fitted) and fitted > 0 else 0.0
        self.measured_overhead, self.exit_seconds = get_tp_group().broadcast_object(
            (overhead, measured["exit_step_s"]), src=0)

    def _time_mechanism_share(self) -> float:
        """A step at the deepest candidate exit over a full-depth step (the
        most a round's share can be; each round's is `mechanism_share`)."""
        from vllm.distributed import get_tp_group

        from vllm_selfspec.proposers.timing import draft_step_seconds

        self.time_exits()
        self.full_depth_seconds = get_tp_group().broadcast_object(
            draft_step_seconds(self.vllm_config, self.base_draft), src=0)
        return self.exit_seconds[self.options.exit_layers[-1]] / self.full_depth_seconds

    def mechanism_share(self, req_ids: list[str]) -> float:
        """A step to the deepest exit these requests last chose to draft at
        over a full-depth step, as timed at start-up (requests that never
        chose: the deepest candidate; before any timing: the layers' share)."""
        deepest = max(self.drafting_exits.get(req_id, self.options.exit_layers[-1])
                      for req_id in req_ids)
        if not self.exit_seconds or not self.full_depth_seconds:
            return deepest / self.model.plan.num_layers
        return self.exit_seconds[deepest] / self.full_depth_seconds

    def _shadow_counts(self, verified: VerifiedTokens) -> torch.Tensor:
        """[batch, 4, candidates]: valid positions (repeated per candidate),
        matched shadow tokens, their summed confidence, and the mismatched ones'."""
        window = self.options.stat_positions
        batch_size = verified.last_rows.shape[0]
        offsets = torch.arange(window - 1, -1, -1, device=self.device)
        rows = verified.last_rows.view(-1, 1) - offsets
        valid = rows >= verified.first_rows.view(-1, 1)
        owner = torch.arange(batch_size, device=self.device).view(-1, 1).expand_as(rows)
        rows, owner = rows[valid], owner[valid]
        following = torch.where(
            rows == verified.last_rows[owner], verified.next_token_ids[owner],
            verified.token_ids[(rows + 1).clamp(max=verified.token_ids.numel() - 1)])
        num_exits = len(self.options.exit_layers)
        states = verified.hidden_states[rows].view(rows.numel(), num_exits, -1)
        # One LM-head pass over every exit's rows: the head's weights are read
        # once, not once per exit.
        head_inputs = torch.cat([segment.head_input(states[:, index])
                                 for index, segment in enumerate(self.model.segments)])
        shadow_tokens, confidence = top1(self.model.compute_logits(head_inputs))
        matched_t = (shadow_tokens.view(num_exits, -1) == following).t().float()
        confidence_t = confidence.view(num_exits, -1).t()
        per_row = torch.stack([
            torch.ones_like(matched_t), matched_t, confidence_t * matched_t,
            confidence_t * (1 - matched_t)], dim=1)
        counts = torch.zeros(batch_size, 4, num_exits, device=self.device)
        return counts.index_add_(0, owner, per_row)

    def forget_finished(self, live_req_ids: set[str]) -> None:
        for req_id in set(self.exit_stats) - live_req_ids:
            del self.exit_stats[req_id]
        for req_id in set(self.drafting_exits) - live_req_ids:
            del self.drafting_exits[req_id]

    def per_request_state(self) -> dict[str, int]:
        return {**super().per_request_state(), "exit_stats": len(self.exit_stats),
                "drafting_exits": len(self.drafting_exits)}

    # --- drafting ---------------------------------------------------------
    def draft_step(self, round_tokens, positions, cad, step, drafting):
        batch_size = round_tokens.shape[0]
        active = drafting & (step < self.plan.max_drafts)
        exit_layers = self.plan.exit_layers()
        flags = active.tolist()
        deepest = max((e for e, on in zip(exit_layers, flags) if on), default=0)
        if deepest == 0:
            return DraftStep(torch.zeros(batch_size, 1, device=self.device), active)
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=step)
        self.input_ids[:batch_size] = round_tokens[:, -1]
        chosen = None
        hidden_states = residual = None
        with self.draft_forward_context(per_layer_metadata, batch_size,
                                        self._get_slot_mapping(batch_size)):
            for segment in self.model.segments:
                if segment.start >= deepest:
                    break
                hidden_states, residual, head_input = segment(
                    self.input_ids[:batch_size], self._get_positions(batch_size),
                    hidden_states, residual)
                rows = [r for r, e in enumerate(exit_layers) if e == segment.end]
                if not rows:
                    continue
                index = torch.tensor(rows, device=self.device)
                logits = self.model.compute_logits(head_input[index])
                if chosen is None:
                    chosen = logits.new_zeros(batch_size, logits.shape[-1])
                chosen[index] = logits
        self.policy.add_draft_step(deepest)
        confidence = top1_probability(chosen)
        num_layers = self.model.plan.num_layers
        early = torch.tensor([e < num_layers for e in exit_layers], device=self.device)
        return DraftStep(chosen, active & (confidence >= self.plan.thresholds),
                         by_mechanism=early)


CONFIG_CLASS = DelConfig
PROPOSER_CLASS = DelProposer
