"""The self-speculative draft engine shared by every method.

vLLM builds this proposer where it would build a draft-model proposer, so its
runner hands us the sampled tokens and the verification step's attention
metadata on the device, reserves `num_speculative_tokens` lookahead KV slots
per request, and verifies our drafts with its rejection sampler.

One round, per request: the sampled token at position p runs through the
draft plan's sub-blocks (writing draft KV at p into the target's own slots),
its argmax is draft 1 at p+1, and so on for k steps. The verification forward
rewrites every layer's KV at those positions, and attention never reads at or
past a request's sequence length, so draft KV never reaches the target.

Greedy requests' drafts are argmax tokens; a sampled request's self-drafts are
drawn from the draft's own distribution q at its temperature and handed to
vLLM's rejection sampler with q (`draft/sampling.py`; with
`draft_sample_method: "greedy"`, argmax tokens without probabilities, which
the sampler treats as one-hot). Either way it accepts a draft with
min(1, p_target / q) and resamples from the remainder on rejection, which keeps
the target distribution exactly at any temperature.

Methods state only what differs: the draft model (`build_draft`, by default
the layer plan's sub-blocks), one draft step (`draft_step`, by default the
newest token through that model), when a request stops drafting within a round
(`stop_after`, given the step's draft logits), and per-request feedback from the
previous round (`observe_round`). Stopped requests are padded with NO_DRAFT,
which the runner hook strips before scheduling.

A method whose draft skips layers or exits early (its mechanism) has the
full-depth draft over the same weights as its base (`full_depth`): each
drafting round goes to whichever of the two the measured acceptances and costs
favour (`policy/mechanism_gate.py`). A base round drafts as `draft_verify` at
its defaults does: the full-depth draft step (`base_step`), at most
REFERENCE_MAX_DRAFTS drafts, each request's stopping below its own adaptive
confidence threshold.

Whether a round drafts, and how far, is decided on host values alone by the
round policy (`policy/rounds.py`), which this proposer feeds from vLLM's runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from vllm.compilation.backends import set_model_tag
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_selfspec.config import SelfSpecConfig
from vllm_selfspec.draft.model import (
    EagerPlanDraft,
    LayerSubsetDraft,
    draft_compile_config,
    key_compile_cache,
)
from vllm_selfspec.draft.plan import LayerPlan
from vllm_selfspec.draft.lookup import (
    Lookup,
    make_lookup,
    request_contexts,
)
from vllm_selfspec.draft.sampling import DraftSampler
from vllm_selfspec.draft.tokens import BASE, LOOKUP, MECHANISM, NO_DRAFT, top1_probability
from vllm_selfspec.draft.weights import DraftWeights
from vllm_selfspec.models import adapter_for
from vllm_selfspec.policy.confidence_stop import REFERENCE_MAX_DRAFTS, ConfidenceStop
from vllm_selfspec.policy.mechanism_gate import RoundSources, SourceChoice
from vllm_selfspec.policy.payoff import ForwardTimes, StepCosts
from vllm_selfspec.policy.rounds import DraftDecision, RoundPolicy
from vllm_selfspec.proposers.draft_metadata import decode_metadata


@dataclass(frozen=True)
class DraftStep:
    """One draft step's result: each request's draft logits, which rows hold a
    draft (None: every row still drafting), and which drafts the method's own
    mechanism made (skipped layers, an early exit) rather than the full-depth
    base (one bool for every row, or a bool tensor per row)."""

    logits: torch.Tensor
    is_draft: torch.Tensor | None = None
    by_mechanism: torch.Tensor | bool = False


@dataclass(frozen=True)
class VerifiedTokens:
    """The forward that just ran (a verification, or a prefill chunk), flat
    over the batch: its input tokens, the hidden states the target returned for
    the drafter (per-layer states when a method asks for them), each request's
    next token, the row of each request's last valid token, where each
    request's rows start, the tokens' positions, and the forward's attention
    metadata (block tables)."""

    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    next_token_ids: torch.Tensor
    last_rows: torch.Tensor
    first_rows: torch.Tensor
    positions: torch.Tensor
    attn_metadata: CommonAttentionMetadata


class SelfSpecProposer(DraftModelProposer):
    """k draft steps over a subset of the target's own layers and KV cache."""

    options: SelfSpecConfig

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        # DraftModelProposer.__init__ checks a separate draft model; we have none.
        SpecDecodeBaseProposer.__init__(
            self, vllm_config, device, pass_hidden_states_to_model=False, runner=runner
        )
        self.runner = runner
        self.options = self.speculative_config
        self._costs_timed = False  # at start-up, by `initialize_attn_backend`
        self.vocab_mapping = None
        # Whether vLLM ran the drafter in the current step (the runner hooks).
        self.proposed_this_step = False
        # Drafts vLLM scheduled (so verified) per request in the forward that
        # just ran, in batch order; None when it verified none.
        self._verified_drafts: list[int] | None = None
        self._early: tuple[float, DraftDecision] | None = None  # (started, decided to draft)
        # This round's self-drafts made by the method's mechanism, per row and
        # draft ([batch, k] bools on the device; None: the round ran no draft
        # step), read once the drafts reach the host (`draft_sources`).
        self._by_mechanism: torch.Tensor | None = None
        self.lookup: Lookup | None = None  # the `lookup` option's source
        # The mechanism against the full-depth base (`full_depth`; set at load
        # for a method with a mechanism): the base's draft, the sources'
        # per-request state and gate, the mechanism's draft step over the
        # base's (timed at start-up; 1 where nothing was timed then: the
        # mechanism must win on acceptance), and this self-drafting round's
        # source.
        self.base_draft: nn.Module | None = None
        self.sources: RoundSources | None = None
        self.mechanism_step_share = 1.0
        self.source: SourceChoice | None = None
        # Records, clock, costs, the last round: cost-aware drafting's state.
        self.policy = RoundPolicy(self.options, self.num_speculative_tokens,
                                  self._time_forwards, share=_from_rank_0)

    # --- what a method states -------------------------------------------------
    def layer_plan(self, num_layers: int) -> LayerPlan:
        raise NotImplementedError

    def observe_round(self, req_id: str, accepted: int, drafted: int) -> None:
        """Feedback on a request's previous round of the method's own drafts
        (called before drafting; a base round's goes to the base's stop)."""

    def has_mechanism(self) -> bool:
        """Whether the method's draft differs from the full-depth draft (a
        layer plan that skips any sub-block, for plan-based methods)."""
        return self.model.plan.fraction_run < 1.0

    def base_step(self, round_tokens: torch.Tensor, positions: torch.Tensor,
                  cad: CommonAttentionMetadata, step: int,
                  drafting: torch.Tensor) -> DraftStep:
        """One full-depth draft step (a base round). Default: the newest token
        through the full plan's draft."""
        return self._plan_step(self.base_draft, round_tokens, cad, step)

    def mechanism_share(self, req_ids: list[str]) -> float:
        """A mechanism draft step over the base's for this round's requests
        (called before `begin_round`). Default: the plans' ratio timed at
        start-up."""
        return self.mechanism_step_share

    def stop_after(
        self, req_ids: list[str], logits: torch.Tensor, step: int
    ) -> torch.Tensor | None:
        """Bool per request: stop drafting after this step's token. None: never."""
        return None

    def stop_below_threshold(self, stop: ConfidenceStop, req_ids: list[str],
                             logits: torch.Tensor, step: int) -> torch.Tensor | None:
        """`stop_after` by each request's confidence threshold (`stop`)."""
        if stop.never_stops():
            return None
        confidence = top1_probability(logits)
        if step == 0:  # thresholds change only between rounds
            self._round_gammas = torch.tensor(stop.gammas(req_ids), dtype=confidence.dtype,
                                              device=confidence.device)
        return confidence < self._round_gammas

    def forget_finished(self, live_req_ids: set[str]) -> None:
        """Drop per-request state of requests vLLM no longer holds (finished
        or aborted); preempted and unscheduled requests keep theirs."""

    def begin_round(self, req_ids: list[str], verified: VerifiedTokens) -> None:
        """Look at the forward that just ran, in a round that self-drafts
        (called before its first draft step, after its source is chosen:
        `self.source`)."""

    def mechanism_drafts(self) -> bool:
        """Whether the method's own choice for this round (made in
        `begin_round`) drafts for any request; where it does not, the base
        drafts the round. Default: it does."""
        return True

    def per_request_state(self) -> dict[str, int]:
        """Requests with state held now, per kind of state: the requests vLLM
        holds at most, so growth after requests finish is a leak."""
        lookup = {} if self.lookup is None else self.lookup.per_request_state()
        base = {} if self.sources is None else self.sources.per_request_state()
        return {**self.policy.per_request_state(), **lookup, **base}

    # --- vLLM's proposer interface -------------------------------------------
    def draft_depth(self, num_layers: int) -> int:
        """How many of the target's layers any draft of this method runs
        through (only those get low-precision copies)."""
        return num_layers

    def load_model(self, target_model: nn.Module) -> None:
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.target_model = target_model
        adapter = adapter_for(target_model)
        decoder = adapter.decoder(target_model)
        layers = decoder.layers
        vocab = self.options.draft_vocab_token_ids(final_norm=decoder.norm.weight)
        # vLLM's CPU int8 kernel takes its output dtype from the default dtype.
        with set_default_torch_dtype(self.vllm_config.model_config.dtype):
            self.draft_weights = DraftWeights.build(
                target_model, layers, self.options.draft_precision, vocab,
                self.draft_depth(len(layers)))
        self.model = self.build_draft(len(layers))
        if self.options.full_depth and self.has_mechanism():
            self.base_draft = self.build_base_draft(len(layers))
            self.sources = RoundSources()
        # Metadata is built per attention backend, not per layer, so naming
        # every target layer costs nothing and lets any plan run.
        self._draft_attn_layer_names = {
            layer.self_attn.attn.layer_name for layer in layers
        }
        self.lookup = make_lookup(self.options.lookup,
                                  self.vllm_config.model_config.max_model_len)

    def build_draft(self, num_layers: int) -> nn.Module:
        return self._build_draft(self.layer_plan(num_layers))

    def build_base_draft(self, num_layers: int) -> nn.Module:
        """The full-depth draft of base rounds. Default: the full plan's."""
        return self._build_draft(LayerPlan.skipping(num_layers, [], []))

    def _build_draft(self, plan: LayerPlan, cache_key: str | None = None) -> LayerSubsetDraft:
        """The plan's draft module, compiled (in compiled engines) at its first
        forward and filed in vLLM's graph cache under `cache_key` (default:
        the plan's own key)."""
        with (set_model_tag("selfspec_draft"),
              draft_compile_config(self.vllm_config, self.draft_weights.layers) as config):
            draft = LayerSubsetDraft(
                vllm_config=config,
                target=self.target_model,
                adapter=adapter_for(self.target_model),
                weights=self.draft_weights,
                plan=plan,
            )
        key_compile_cache(draft, cache_key or f"plan_{plan.digest()}")
        return draft

    def replace_layer_plan(self, plan: LayerPlan) -> None:
        """Draft with another plan from the next round on, run eagerly."""
        self.model = self.eager_draft(plan)

    def eager_draft(self, plan: LayerPlan) -> EagerPlanDraft:
        """An uncompiled draft running `plan` over this proposer's draft weights."""
        return EagerPlanDraft(self.target_model, adapter_for(self.target_model),
                              self.draft_weights, plan)

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings=None) -> None:
        """One forward of the drafting draft and, where it is compiled, of the
        full-depth base, at the profiling size, not one per speculative token
        as vLLM's does: draft steps keep no activations and run the same
        graphs, so more passes measure nothing new and cost minutes of CPU
        start-up at 18-25 speculative tokens. A draft's first compiled call
        must be this one: its graph is traced for any number of tokens here,
        whereas a first call at one token specialises it to one (torch's 0/1
        specialisation) and vLLM calls compiled graphs without guards, so
        larger batches would run a one-token graph. The runner's flags pass
        through unchanged (docs/gpu-runner-reading.md)."""
        configured, drafting = self.num_speculative_tokens, self.model
        self.num_speculative_tokens = 1
        try:
            compiled_base = (self.base_draft is not None
                             and not getattr(self.base_draft, "do_not_compile", True))
            for draft in (drafting, *([self.base_draft] if compiled_base else [])):
                self.model = draft
                super().dummy_run(num_tokens, use_cudagraphs, is_graph_capturing,
                                  slot_mappings=slot_mappings)
        finally:
            self.num_speculative_tokens, self.model = configured, drafting

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        """vLLM's; then, at the first call, the draft's costs are timed
        (`time_costs`), so that no user's request waits for them. vLLM calls
        this from the runner's KV-cache set-up, on every rank, after the
        profiling run has compiled the target (on a GPU, before graph
        capture). vLLM's CPU worker skips that run under its own CI switch;
        the target's first compiled call must not be a timing forward, so
        there the costs are timed at first use instead."""
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        if not self._costs_timed and not _cpu_warm_up_skipped():
            self._costs_timed = True
            self.time_costs()

    def time_costs(self) -> None:
        """What the method's decisions need timed before any request: the
        profiling-mode forward times behind cost-aware drafting's stand-in
        costs. A cost not timed here (an option switched on while serving;
        vLLM's CPU CI) is timed at first use."""
        if self.options.cost_aware:
            self.policy.forward_times = self._time_forwards()
        if self.sources is not None:
            self.mechanism_step_share = self._time_mechanism_share()

    def timed_at_start_up(self) -> dict:
        """What `time_costs` holds (None where nothing was timed)."""
        forward_times = self.policy.forward_times
        return {"forward_times": None if forward_times is None
                else forward_times.describe()}

    def _time_mechanism_share(self) -> float:
        """The mechanism's draft step over the full-depth one at batch 1, timed
        (rank 0's on every rank). Default: the two plans' drafts."""
        from vllm.distributed import get_tp_group

        from vllm_selfspec.proposers.timing import draft_step_seconds

        ratio = (draft_step_seconds(self.vllm_config, self.model)
                 / draft_step_seconds(self.vllm_config, self.base_draft))
        return get_tp_group().broadcast_object(ratio, src=0)

    def _time_forwards(self) -> ForwardTimes:
        """The profiling-mode forward times: every rank runs the timing
        forwards (they hold tensor-parallel collectives); rank 0's numbers are
        the ones all ranks use."""
        from vllm.distributed import get_tp_group

        from vllm_selfspec.proposers.timing import time_forwards

        return get_tp_group().broadcast_object(
            time_forwards(self.runner, self, self.num_speculative_tokens), src=0)

    def initialize_cudagraph_keys(self, cudagraph_mode) -> None:
        """No CUDA-graph keys for the draft: our loop runs its draft modules
        without graphs (`draft_forward_context`), so capturing any at start-up
        would only cost time and memory."""
        from vllm.config import CUDAGraphMode

        self.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)

    def draft_forward_context(self, attn_metadata, num_tokens: int, slot_mapping):
        """The forward context of a draft forward: no CUDA graph. vLLM's own
        loop pads to captured sizes and replays graphs; ours changes shapes
        and modules per step and request (exits, plans, windows), which a graph
        captured at start-up cannot follow."""
        from vllm.config import CUDAGraphMode

        return set_forward_context(attn_metadata, self.vllm_config, num_tokens=num_tokens,
                                   cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                   slot_mapping=slot_mapping)

    def decline_early(self, num_speculative_tokens: int, num_tokens: int,
                      spec_decode_metadata) -> bool:
        """Called by the runner before vLLM's drafting glue (next tokens,
        input slices) in every synchronous round. After a forward that verified
        no drafts (no spec-decode metadata: integration/patches.py gives a batch without
        drafts none), decide this round on the host alone and, when it drafts
        nothing, finish it here, so the glue is not paid either; a round that
        drafts goes on to `propose` with the decision made. False at once after
        a forward that verified drafts (their feedback comes first) or with
        lookup (it needs the sampled tokens): `propose` decides."""
        self._early = None  # a decision is for its own round only
        self._by_mechanism = None
        if spec_decode_metadata is not None:
            return False  # drafts were verified: feedback first
        policy = self.policy
        if self.lookup is not None and not policy.next_round_closed(
                len(self.runner.input_batch.req_ids), lookups=True):
            return False  # lookup needs the sampled tokens: `propose` decides
        if policy.repeat_decline(self.runner.input_batch.req_ids, self.runner.requests,
                                 num_tokens):
            return True
        started = time.perf_counter()
        req_ids = list(self.runner.input_batch.req_ids)
        self._verified_drafts = None
        self._start_round(req_ids, None, num_tokens, started)
        decision = policy.decide(req_ids, num_speculative_tokens, self._may_draft(req_ids))
        if decision is None:
            policy.end_round(req_ids, 0, started, time.perf_counter())
            return True
        self._early = (started, decision)
        return False

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        req_ids = list(self.runner.input_batch.req_ids)
        batch_size = len(req_ids)
        self._last_draft_probs = None  # set by a round that samples drafts
        self._by_mechanism = None  # set by a round that self-drafts
        drafts = torch.full((batch_size, num_speculative_tokens), NO_DRAFT,
                            dtype=torch.int64, device=self.device)
        rows: dict[int, int] = {}  # the rows whose drafts are looked up: their match lengths
        policy = self.policy
        if self._early is not None:  # decided in `decline_early`: it drafts
            (started, decision), self._early = self._early, None
        else:
            started = time.perf_counter()
            verified, self._verified_drafts = self._verified_drafts, None
            num_tokens = target_token_ids.shape[0]
            self._start_round(req_ids, verified, num_tokens, started)
            rejected = (None if num_rejected_tokens_gpu is None or verified is None
                        else num_rejected_tokens_gpu.tolist())
            feedback = policy.take_feedback(req_ids, verified, rejected, num_tokens, started)
            for req_id, accepted, scheduled in feedback.self_drafted:
                self._observe_source(req_id, accepted, scheduled)
            may_draft = self._may_draft(req_ids)
            costs = policy.lookup_costs(batch_size) if self.lookup is not None else None
            if costs is not None:
                rows = self.draft_by_lookup(req_ids, target_token_ids, next_token_ids,
                                            common_attn_metadata, feedback.accepted, drafts,
                                            costs)
                for row in rows:
                    may_draft[row] = False
            policy.note_lookups(req_ids, {req_ids[row]: match for row, match in rows.items()})
            decision = policy.decide(req_ids, num_speculative_tokens, may_draft)
        steps = 0
        if decision is not None:
            steps = self._draft_loop(
                drafts, req_ids, decision, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, num_rejected_tokens_gpu, sampling_metadata)
        policy.end_round(req_ids, steps, started, time.perf_counter(), bool(rows))
        return drafts

    def skip_round(self) -> None:
        """A step whose drafter vLLM did not run (some request's length plus
        k would pass max_model_len; vLLM then fills every row with token 0,
        which the runner hook drops): no request drafts, the drafts the forward
        verified give no feedback, and no round is timed across it."""
        self._verified_drafts = None
        self._early = None
        self.policy.skip_round(list(self.runner.input_batch.req_ids))

    def _observe_source(self, req_id: str, accepted: int, drafted: int) -> None:
        """A request's verified self-drafts: to the sources' gate and stop,
        and the mechanism's to the method's own feedback."""
        if self.sources is None or self.sources.observe(req_id, accepted, drafted):
            self.observe_round(req_id, accepted, drafted)

    def _choose_source(self, req_ids: list[str]) -> SourceChoice | None:
        """This self-drafting round's source (None: the method has no
        mechanism, or `full_depth` is off)."""
        if self.sources is None:
            return None
        costs = self.policy.timed_costs(len(req_ids)) if self.options.cost_aware else None
        source = self.sources.choose(
            req_ids, costs or None,
            (self.num_speculative_tokens, min(self.num_speculative_tokens,
                                              REFERENCE_MAX_DRAFTS)),
            self.mechanism_share(req_ids))
        self.source = source
        return source

    def _start_round(self, req_ids: list[str], verified: list[int] | None,
                     num_tokens: int, started: float) -> None:
        """The policy's start of a round (`RoundPolicy.start_round`), and the
        method's own state of requests vLLM no longer holds dropped with the
        policy's (`forget_finished`)."""
        live = self.policy.start_round(req_ids, self.runner.requests, verified, num_tokens,
                                       started)
        if live is not None:
            self.forget_finished(live)
            if self.sources is not None:
                self.sources.forget(live)
            if self.lookup is not None:
                self.lookup.forget(live)

    def _may_draft(self, req_ids: list[str]) -> list[bool]:
        """Per request: it has a token to continue from. One whose prompt is
        still prefilling in chunks has none yet (vLLM discards its sample)."""
        return (~self.runner.discard_request_mask.np[:len(req_ids)]).tolist()

    def _draft_loop(self, drafts: torch.Tensor, req_ids: list[str], decision: DraftDecision,
                    target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                    target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                    token_indices_to_sample: torch.Tensor | None,
                    common_attn_metadata: CommonAttentionMetadata,
                    num_rejected_tokens_gpu: torch.Tensor | None,
                    sampling_metadata: SamplingMetadata) -> int:
        """Run the decided draft steps, writing `drafts` (and, for sampled
        requests, the drafts' distribution: `draft/sampling.py`);
        returns the steps run."""
        batch_size = len(req_ids)
        sampler = None
        if self.options.draft_sample_method == "probabilistic":
            sampler = DraftSampler.for_round(sampling_metadata, batch_size, drafts.shape[1],
                                             self.vllm_config.model_config.get_vocab_size())
        may_draft, budgets = decision.may_draft, decision.budgets
        drafting = torch.tensor(may_draft, device=self.device)
        if budgets is not None:
            budget = torch.tensor(budgets, device=self.device)
        if token_indices_to_sample is None:
            token_indices_to_sample = common_attn_metadata.query_start_loc[1:] - 1
        source = self._choose_source(req_ids)
        # Only a round that self-drafts pays for the method's look at the
        # forward (DEL's shadow tokens, SWIFT's search): a declined round
        # costs what a plain step costs.
        self.begin_round(req_ids, VerifiedTokens(
            target_token_ids, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata.query_start_loc[:batch_size],
            target_positions, common_attn_metadata))
        if source is not None and source.mechanism and not self.mechanism_drafts():
            source = self.source = self.sources.fall_back(req_ids)
        if source is not None and source.trial:
            self.policy.note_trials(req_ids)
        base_round = source is not None and not source.mechanism
        num_steps = min(decision.steps, REFERENCE_MAX_DRAFTS) if base_round else decision.steps
        positions = target_positions[token_indices_to_sample]
        cad = decode_metadata(common_attn_metadata, num_rejected_tokens_gpu, self.arange,
                              self.token_arange_np)
        # The round's tokens so far: the sampled token, then each step's draft.
        round_tokens = next_token_ids.view(batch_size, 1)
        by_mechanism = torch.zeros(drafts.shape, dtype=torch.bool, device=self.device)
        steps_run = 0
        for step in range(num_steps):
            if budgets is not None:
                drafting &= budget > step
            steps_run += 1
            positions = self._advance(positions, cad, batch_size)
            result = (self.base_step if base_round else self.draft_step)(
                round_tokens, positions, cad, step, drafting)
            logits, is_draft = result.logits, result.is_draft
            # One float copy for the argmax and the methods' confidence: over
            # bf16 logits the CPU's argmax is a scalar loop.
            logits = logits.float()
            token_ids = (logits.argmax(dim=-1) if sampler is None
                         else sampler.sample(logits, positions))
            round_tokens = torch.cat([round_tokens, token_ids.view(batch_size, 1)], dim=1)
            if is_draft is not None:
                drafting &= is_draft
            # Rows not drafting keep what they have (NO_DRAFT, or a lookup draft).
            drafts[:, step] = torch.where(drafting, token_ids, drafts[:, step])
            by_mechanism[:, step] = drafting & result.by_mechanism
            if sampler is not None:
                sampler.keep(step, drafting)
            stop = (self.stop_below_threshold(self.sources.base_stop, req_ids, logits, step)
                    if base_round else self.stop_after(req_ids, logits, step))
            if stop is not None:
                drafting &= ~stop
            if (is_draft is not None or stop is not None) and not bool(drafting.any()):
                break
        if sampler is not None:
            self._last_draft_probs = sampler.round_probs(drafts)
        self._by_mechanism = by_mechanism
        if source is not None:
            self.sources.gate.record_steps(source.mechanism, steps_run)
        return steps_run

    def draft_sources(self, req_ids: list[str], rows: list[list[int]]) -> list[str]:
        """Per request, one code per draft of this round's `rows` (the drafts
        as scheduled): LOOKUP, MECHANISM or BASE (`integration/token_sources.py`).
        Called once the drafts are on the host, so reading the device mask
        waits for nothing."""
        by_mechanism = None if self._by_mechanism is None else self._by_mechanism.tolist()
        codes = []
        for row, (req_id, drafts) in enumerate(zip(req_ids, rows)):
            if self.policy.was_looked_up(req_id):
                codes.append(LOOKUP * len(drafts))
            elif by_mechanism is None:
                codes.append(BASE * len(drafts))
            else:
                codes.append("".join(MECHANISM if made else BASE
                                     for made in by_mechanism[row][:len(drafts)]))
        return codes

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata,
                              valid_sampled_tokens_count):
        """vLLM's, noting how many drafts it scheduled per request: only those
        were verified (budget and structured-output trims, chunked prefill drop
        the rest), so only those become acceptance feedback. (A batch without
        drafts has no spec-decode metadata and does not come here, except on a
        hybrid model, which keeps vLLM's metadata: integration/patches.py.)"""
        self._verified_drafts = list(spec_decode_metadata.num_draft_tokens)
        return super().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata,
                                             valid_sampled_tokens_count)

    # --- lookup drafts ---------------------------------------------------------
    def draft_by_lookup(self, req_ids: list[str], step_tokens: torch.Tensor,
                        next_token_ids: torch.Tensor, cad: CommonAttentionMetadata,
                        accepted: dict[str, int], drafts: torch.Tensor,
                        costs: StepCosts | Literal[False]) -> dict[int, int]:
        """Fill `drafts` for the requests the lookup source offers a draft
        (draft/lookup.py), each cut to what pays where the source estimates
        its chance (and left to self-draft where that promises more); returns
        their rows, each with the length of the match that found its draft
        (0 where the source does not say)."""
        batch = self.runner.input_batch
        lengths = self.policy.lookup_lengths(
            req_ids, costs, min(drafts.shape[1], self.options.lookup["max_tokens"]),
            source_sizes_drafts=self.lookup.sizes_drafts)
        contexts = request_contexts(
            req_ids, self.runner.discard_request_mask.np, batch.token_ids_cpu,
            batch.num_tokens_no_spec, step_tokens.tolist(), cad.query_start_loc_cpu.tolist(),
            next_token_ids.tolist(), accepted)
        rows = {}
        # Only a source that sizes its drafts weighs them against the self-draft.
        self_costs = self.policy.timed_costs(len(req_ids)) if self.lookup.sizes_drafts else None
        for row, draft in self.lookup.drafts(contexts, lengths, batch.num_prompt_tokens).items():
            length = (len(draft.tokens) if draft.path_probabilities is None
                      else self.policy.source_draft_length(
                          req_ids[row], draft.path_probabilities, draft.match_length,
                          len(req_ids), costs, self_costs))
            if length:
                drafts[row, :length] = torch.from_numpy(draft.tokens[:length]).to(drafts.device)
                rows[row] = draft.match_length
        return rows

    # --- the draft loop's pieces ---------------------------------------------
    def _advance(
        self, positions: torch.Tensor, cad: CommonAttentionMetadata, batch_size: int
    ) -> torch.Tensor:
        """Next position, its slot in the target's block table, seq_len + 1."""
        return self._update_positions_dependent_metadata(
            positions, cad, batch_size, batch_size, self.block_size
        )

    def draft_step(
        self,
        round_tokens: torch.Tensor,
        positions: torch.Tensor,
        cad: CommonAttentionMetadata,
        step: int,
        drafting: torch.Tensor,
    ) -> DraftStep:
        """Logits of each request's next draft, which of them are drafts, and
        which the mechanism made. Default: the newest token through the layer
        plan (the mechanism's where the plan skips any sub-block)."""
        return self._plan_step(self.model, round_tokens, cad, step)

    def _plan_step(self, model: nn.Module, round_tokens: torch.Tensor,
                   cad: CommonAttentionMetadata, step: int) -> DraftStep:
        """The newest token of each request through `model`'s layer plan."""
        batch_size = round_tokens.shape[0]
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=step
        )
        self.input_ids[:batch_size] = round_tokens[:, -1]
        with self.draft_forward_context(per_layer_metadata, batch_size,
                                        self._get_slot_mapping(batch_size)):
            hidden_states = model(
                input_ids=self.input_ids[:batch_size],
                positions=self._get_positions(batch_size),
            )
        plan = model.plan
        self.policy.add_draft_step(plan.fraction_run * plan.num_layers)
        return DraftStep(model.compute_logits(hidden_states[:batch_size]),
                         by_mechanism=plan.fraction_run < 1.0)


def _cpu_warm_up_skipped() -> bool:
    """vLLM's CPU worker ran no profiling forward before the KV cache
    (`CPUWorker._should_warm_up_model`: its CI switch)."""
    from vllm import envs
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and envs.VLLM_CPU_CI_ENV


def _from_rank_0(make: Callable[[], Any]) -> Any:
    """`make()` on tensor-parallel rank 0, its value on every rank (a
    collective: every rank calls this at the same point; `make` runs on rank 0
    only)."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    return tp.broadcast_object(make() if tp.rank_in_group == 0 else None, src=0)
