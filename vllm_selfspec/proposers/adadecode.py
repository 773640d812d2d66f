"""AdaDecode (Wei et al., ICML 2025): adaptive-depth early prediction with
trained exit heads, verified losslessly.

Each draft token runs the target's layers segment by segment and is emitted at
the first exit head whose top-1 probability exceeds `threshold`. A token no
head is sure of runs on to the last layer and is drafted there by the model's
own head (`full_depth`, the default): the full-depth draft over the cheap
base's weights, so an early exit only ever replaces a dearer draft of the same
token. The base drafts as `draft_verify` at its defaults does: rounds of up to
num_speculative_tokens (12) drafts, each request's ending after a draft below
its adaptive confidence threshold (`policy/confidence_stop.py`); at most
`max_early` of a round's drafts come from the heads.

Over that base each head drafts only while it pays: cost-aware, the engine
weighs each head's measured acceptance and the draft step it saves against the
base's acceptance on the tokens that head is sure of (`policy/exit_gate.py`); a
closed head's tokens go deeper (its logits are not computed), and with every
head closed a round is the base's own, one token per step without the window
below. In every 32 drafting rounds one opens every head and one is a shadow
round (every head's confidence read, every token drafted at full depth), so
both records stay current, and a head with no record yet opens one round in
16; a round that opens heads to measure them, not because they pay, is a
trial, kept out of the requests' acceptance records.
With `full_depth: false` a token no head is sure of ends the request's drafts
and the verification forward produces it, as AdaDecode's last layer does, and
a round is at most `max_early` drafts long.

The deeper layers of an early token are deferred, not dropped: the next draft
step's query holds the whole round so far (the sampled token and every earlier
draft) beside the new token, so when the new token reaches a layer, the
earlier tokens' KV at that layer is computed in the same batched forward, in
the target's paged cache. Unlike AdaDecode, which carries each deferred token's
hidden state, the window restarts from layer 0: it recomputes a few shallow
rows instead of keeping per-token state, and costs no extra sequential steps.
The verification forward completes every layer for all drafts at once.

Greedy requests' drafts are the exiting head's argmax; a sampled request's
are drawn from that head's distribution and verified with it (the shared
`draft_sample_method`), so vLLM's rejection sampler keeps the target
distribution at any temperature (the paper's min(1, p*/p_i) rule).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from vllm.config.utils import config

from vllm_selfspec.config import Option
from vllm_selfspec.draft.tokens import top1_probability
from vllm_selfspec.policy.confidence_stop import (
    REFERENCE_MAX_DRAFTS,
    REFERENCE_RULE,
    ConfidenceStop,
)
from vllm_selfspec.policy.exit_gate import BASE, ExitGate, GateRound
from vllm_selfspec.proposers.base import DraftStep, VerifiedTokens
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
    threshold: Annotated[float | None, Option(0.75, ge=0)] = None
    """A token is emitted at the first head whose top-1 probability exceeds
    this; above 1 nothing exits early (every draft is full depth, or with
    full_depth false there is none: plain decoding)."""
    max_early: Annotated[int | None, Option(5, ge=1)] = None
    """The most early predictions outstanding: a round's drafts made by exit
    heads (with full_depth false every draft is, so it bounds the round's
    length)."""

    default_num_speculative_tokens = REFERENCE_MAX_DRAFTS

    def validate_method_fields(self) -> None:
        self.validate_heads_field()

    def validate_for_model(self, num_layers: int) -> None:
        super().validate_for_model(num_layers)
        if not self.full_depth or num_layers in self.exit_layers:
            # No full-depth base (or a head at the last layer stands for it):
            # every draft is a head's, so a round is at most max_early drafts.
            self.num_speculative_tokens = min(self.num_speculative_tokens, self.max_early)

    def method_hash_factors(self) -> list:
        return [self.heads, self.exit_layers, self.full_depth]


class AdaDecodeProposer(EarlyExitProposer):
    options: AdaDecodeConfig

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        # Over the full-depth base: which heads pay (built with the draft).
        self.exit_gate: ExitGate | None = None
        # The end of the segment `segment_ends` added past the heads' exits
        # (full_depth): every token still undecided there is drafted, by the
        # base. None: no such segment (full_depth false, or a head at the
        # last layer), and then no gate.
        self.fallback_end: int | None = None
        self.gate_round: GateRound | None = None  # this round's; None: every head
        # The last self-drafting round: each request's row, and per row and
        # draft its source (a head, BASE, or a shadowed head), read on the
        # host when the next round's feedback arrives.
        self._round_rows: dict[str, int] = {}
        self._round_sources: torch.Tensor | list[list[int]] | None = None
        # Each row's early drafts in this round (at most max_early).
        self._early_drafts: torch.Tensor | None = None
        # The full-depth base's stop: draft_verify's at its defaults.
        self.confidence_stop = ConfidenceStop(REFERENCE_RULE)

    def segment_ends(self, num_layers: int) -> list[int]:
        """The exits, then the last layer where tokens no head is sure of go
        on to it (`full_depth`)."""
        ends = super().segment_ends(num_layers)
        return ends + [num_layers] if self.options.full_depth and ends[-1] < num_layers else ends

    def has_mechanism(self) -> bool:
        """False: the heads draft within the base's rounds, each weighed
        against it by the exit gate, not a round's whole source."""
        return False

    def build_draft(self, num_layers: int):
        draft = super().build_draft(num_layers)
        ends = [segment.end for segment in draft.segments]
        if ends[-1] not in self.options.exit_layers:  # the full-depth base's segment
            self.fallback_end = ends[-1]
            self.exit_gate = ExitGate([end / num_layers for end in ends[:-1]])
        return draft

    def observe_round(self, req_id: str, accepted: int, drafted: int) -> None:
        """The base's threshold moves (not on a trial: the heads' drafts, not
        the base's, made it); the gate learns each head's acceptance and the
        base's. The round fed back is the last that self-drafted, whose heads
        `gate_round` still holds."""
        trial = self.gate_round is not None and self.gate_round.trial
        if self.fallback_end is not None and not trial:
            self.confidence_stop.observe(req_id, accepted, drafted)
        row = self._round_rows.get(req_id)
        if self.exit_gate is None or row is None or self._round_sources is None:
            return
        if isinstance(self._round_sources, torch.Tensor):
            self._round_sources = self._round_sources.tolist()  # once per round
        self.exit_gate.record(self._round_sources[row][:drafted], accepted)

    def begin_round(self, req_ids: list[str], verified: VerifiedTokens) -> None:
        """The heads of this round, at its costs (`ExitGate`)."""
        if self.exit_gate is None:
            return
        self._round_rows = {req_id: row for row, req_id in enumerate(req_ids)}
        self._round_sources = torch.full((len(req_ids), self.num_speculative_tokens), BASE,
                                         dtype=torch.int8, device=self.device)
        costs = self.policy.timed_costs(len(req_ids)) if self.options.cost_aware else None
        self.gate_round = self.exit_gate.next_round(costs or None, len(req_ids),
                                                    self.num_speculative_tokens)
        if self.gate_round.trial:
            self.policy.note_trials(req_ids)

    def forget_finished(self, live_req_ids: set[str]) -> None:
        for req_id in set(self._round_rows) - live_req_ids:
            del self._round_rows[req_id]
        self.confidence_stop.forget(live_req_ids)

    def per_request_state(self) -> dict[str, int]:
        return {**super().per_request_state(), "exit_gate_rows": len(self._round_rows),
                "thresholds": len(self.confidence_stop)}

    def stop_after(self, req_ids, logits, step):
        """Over the full-depth base, the base's confidence stop (`full_depth`
        false: a token no head is sure of ends the drafts instead)."""
        if self.fallback_end is None:
            return None
        return self.stop_below_threshold(self.confidence_stop, req_ids, logits, step)

    def draft_step(self, round_tokens, positions, cad, step, drafting):
        gate = self.gate_round
        no_exit = self.options.threshold >= 1.0 or (
            gate is not None and not gate.shadow and not any(gate.open))
        if no_exit and self.fallback_end is not None:
            return self.full_depth_step(round_tokens, cad, step, drafting)
        batch_size, width = round_tokens.shape
        window_cad, window_positions = window_metadata(cad, positions, width, self.arange,
                                                       self.token_arange_np, self.block_size)
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            window_cad, draft_index=step)
        slots = {name: window_cad.slot_mapping for name in self._draft_attn_layer_names}
        input_ids = round_tokens.reshape(-1).to(torch.int32)
        newest = torch.arange(width - 1, batch_size * width, width, device=self.device)
        exited = ~drafting  # requests that stopped need no deeper layers
        early = torch.zeros_like(drafting)  # drafted at an exit head (the mechanism)
        if step == 0:
            self._early_drafts = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        # A row with max_early early drafts outstanding goes on to full depth.
        exits_left = self._early_drafts < self.options.max_early
        chosen = None
        hidden_states = residual = None
        made_by = torch.full_like(drafting, BASE, dtype=torch.int8)  # each row's source
        with self.draft_forward_context(per_layer_metadata, batch_size * width, slots):
            for head, segment in enumerate(self.model.segments):
                hidden_states, residual, head_input = segment(
                    input_ids, window_positions, hidden_states, residual)
                full_depth = segment.end == self.fallback_end
                if not full_depth and gate is not None and not (
                        gate.open[head] or gate.shadow):
                    continue  # a closed head: its tokens go deeper, unread
                logits = self.model.compute_logits(head_input[newest])
                if full_depth:
                    take = ~exited
                else:
                    sure = (top1_probability(logits) > self.options.threshold) & ~exited
                    if gate is not None and gate.shadow:
                        # Drafted at full depth, noted by the first head sure of it.
                        made_by.masked_fill_(sure & (made_by == BASE),
                                             self.exit_gate.shadowed(head))
                        continue
                    take = sure & exits_left
                    early |= take
                    made_by.masked_fill_(take, head)
                chosen = logits if chosen is None else torch.where(
                    take.view(-1, 1), logits, chosen)
                exited |= take
                if bool(exited.all()):
                    break
        self.policy.add_draft_step(segment.end)
        self._early_drafts += early
        if isinstance(self._round_sources, torch.Tensor) and (
                step < self._round_sources.shape[1]):
            self._round_sources[:, step] = made_by
        return DraftStep(chosen, exited & drafting, by_mechanism=early)

    def full_depth_step(self, round_tokens, cad, step, drafting) -> DraftStep:
        """A round in which no head may exit (the gate closed them all, or the
        threshold is 1 or more) over the full-depth base: no token exits early,
        so every earlier draft's KV is complete and the step runs the newest
        token alone through every segment, as the base's own draft does (no
        window, no head but the last)."""
        batch_size = round_tokens.shape[0]
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=step)
        self.input_ids[:batch_size] = round_tokens[:, -1]
        hidden_states = residual = None
        with self.draft_forward_context(per_layer_metadata, batch_size,
                                        self._get_slot_mapping(batch_size)):
            for segment in self.model.segments:
                hidden_states, residual, head_input = segment(
                    self.input_ids[:batch_size], self._get_positions(batch_size),
                    hidden_states, residual)
            logits = self.model.compute_logits(head_input)
        self.policy.add_draft_step(segment.end)
        return DraftStep(logits, drafting, by_mechanism=torch.zeros_like(drafting))


CONFIG_CLASS = AdaDecodeConfig
PROPOSER_CLASS = AdaDecodeProposer
