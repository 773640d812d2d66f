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
vLLM's rejection sampler with q (`workers/draft_sampling.py`; with
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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

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
from vllm_selfspec.draft_tokens import NO_DRAFT
from vllm_selfspec.models import adapter_for
from vllm_selfspec.workers.draft_model import (
    EagerPlanDraft,
    LayerPlan,
    LayerSubsetDraft,
    key_compile_cache,
)
from vllm_selfspec.workers.draft_sampling import DraftSampler
from vllm_selfspec.workers.draft_payoff import (
    AcceptanceRecords,
    ForwardTimes,
    GoodputGate,
    RoundClock,
    StepCosts,
    batch_bucket,
    batch_steps,
    costs_for,
    probe_interval,
    reopen_interval,
)
from vllm_selfspec.workers.draft_weights import DraftWeights

# Cost-aware drafting: the per-token acceptance assumed before the engine has
# verified any draft (afterwards a new request starts from the engine's own
# record of its drafts), the decay of a request's record per verified round,
# of the engine's (the long run), and of a request's per round it drafts
# nothing (so it drifts back to the engine's record and tries again), and the
# gain over plain decoding a budget must promise (a margin for the error of
# the cost and acceptance estimates). The decays were chosen by simulating
# requests of known acceptance against the costs measured here
# (docs/design.md, "Acceptance records").
PRIOR_ACCEPTANCE = 0.6
PAYOFF_DECAY = 0.9
ENGINE_PAYOFF_DECAY = 0.98
IDLE_DECAY = 0.95
# Lookup records keep the earlier decays (0.8 per verified round, the engine's
# too, no idle forgetting): with the ones above, SmolLM2's copy-heavy set ran
# 1.76x instead of 2.08x in an A/B of the same hour (docs/results.md).
LOOKUP_PAYOFF_DECAY = 0.8
MIN_GAIN = 0.05
PROBE_SHARE = 0.01  # of decoding time, at most, spent on probes that find nothing
# Measured costs are shared from tensor-parallel rank 0 every SHARE_EVERY
# rounds. An engine first decodes PLAIN_ROUNDS_FIRST steady rounds plainly to
# time a plain step, and does so again (one round in SHARE_EVERY) whenever fewer
# than that were timed in the last REFRESH_ROUNDS rounds, as contexts grow; if
# no steady round comes for NOT_STEADY_ROUNDS rounds (a busy server whose batch
# changes every step), the stand-in costs from the start-up forward times
# (`ForwardTimes.prior_at`, per batch size) serve meanwhile.
SHARE_EVERY = 16
REFRESH_ROUNDS = 512
PLAIN_ROUNDS_FIRST = 3
NOT_STEADY_ROUNDS = 2 * SHARE_EVERY


@dataclass(frozen=True)
class RoundTiming:
    """The previous round: its requests, draft steps run, when its drafting
    started and ended, and whether any of its drafts were looked up."""

    req_ids: list[str]
    steps: int
    started: float
    ended: float
    looked_up: bool = False


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


@dataclass(frozen=True)
class DraftDecision:
    """A round that drafts: its draft steps, which requests draft, and each
    request's budget (None when not cost-aware: every step)."""

    steps: int
    may_draft: list[bool]
    budgets: list[int] | None


@dataclass
class DraftCounters:
    """Work done since the engine started, for the benchmark's tokens per
    loaded layer: target forwards (each runs every layer) and draft layers."""

    rounds: int = 0
    draft_steps: int = 0
    draft_layers: float = 0.0

    def add_step(self, layers: float) -> None:
        self.draft_steps += 1
        self.draft_layers += layers


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
        self.start_round_state()

    def start_round_state(self) -> None:
        """The rounds' state, empty: records, clock, costs, the last round."""
        # Drafts vLLM scheduled (so verified) per request in the forward that
        # just ran, in batch order; None when it verified none.
        self._verified_drafts: list[int] | None = None
        self.counters = DraftCounters()
        # Acceptance records for cost_aware; a lookup draft says nothing of
        # the self-draft, and the other way round.
        self.self_records = AcceptanceRecords(PRIOR_ACCEPTANCE, PAYOFF_DECAY,
                                              ENGINE_PAYOFF_DECAY, IDLE_DECAY)
        self.lookup_records = AcceptanceRecords(PRIOR_ACCEPTANCE, LOOKUP_PAYOFF_DECAY,
                                                LOOKUP_PAYOFF_DECAY, idle_decay=1.0)
        # Requests whose newest drafts were looked up. A request vLLM leaves
        # out of a step keeps its drafts and their source until it is verified.
        self.looked_up: set[str] = set()
        self.clock = RoundClock()
        self._previous_round: RoundTiming | None = None
        self.forward_times: ForwardTimes | None = None  # profiling mode, at start-up
        self.shared_costs: dict[int, StepCosts] = {}  # per batch size, rank 0's
        # Whether drafting rounds pay, measured; rank 0's closed buckets, shared.
        self.gate = GoodputGate()
        self.shared_closed: dict[int, float] = {}
        self._round_costs: tuple[int, StepCosts | None | bool] | None = None  # (round, costs)
        self._early: tuple[float, DraftDecision] | None = None  # (started, decided to draft)
        self._held_requests = 0  # requests vLLM held when state was last pruned
        self._quiet_until = 0  # rounds before this one may repeat the last decline

    # --- what a method states -------------------------------------------------
    def layer_plan(self, num_layers: int) -> LayerPlan:
        raise NotImplementedError

    def observe_round(self, req_id: str, accepted: int, drafted: int) -> None:
        """Feedback on a request's previous round (called before drafting)."""

    def stop_after(
        self, req_ids: list[str], logits: torch.Tensor, step: int
    ) -> torch.Tensor | None:
        """Bool per request: stop drafting after this step's token. None: never."""
        return None

    def forget_finished(self, live_req_ids: set[str]) -> None:
        """Drop per-request state of requests vLLM no longer holds (finished
        or aborted); preempted and unscheduled requests keep theirs."""

    def begin_round(self, req_ids: list[str], verified: VerifiedTokens) -> None:
        """Look at the forward that just ran, in a round that self-drafts
        (called before its first draft step)."""

    def per_request_state(self) -> dict[str, int]:
        """Requests with state held now, per kind of state: the requests vLLM
        holds at most, so growth after requests finish is a leak."""
        return {"self_records": len(self.self_records.requests),
                "lookup_records": len(self.lookup_records.requests),
                "looked_up": len(self.looked_up)}

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
        # Metadata is built per attention backend, not per layer, so naming
        # every target layer costs nothing and lets any plan run.
        self._draft_attn_layer_names = {
            layer.self_attn.attn.layer_name for layer in layers
        }
        if self.options.lookup:
            from vllm_selfspec.workers.lookup import compile_lookup

            compile_lookup(self.vllm_config.model_config.max_model_len)

    def build_draft(self, num_layers: int) -> nn.Module:
        return self._build_draft(self.layer_plan(num_layers))

    def _build_draft(self, plan: LayerPlan, cache_key: str | None = None) -> LayerSubsetDraft:
        """The plan's draft module, compiled (in compiled engines) at its first
        forward and filed in vLLM's graph cache under `cache_key` (default:
        the plan's own key)."""
        with set_model_tag("selfspec_draft"):
            draft = LayerSubsetDraft(
                vllm_config=self.vllm_config,
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
        """One draft forward at the profiling size, not one per speculative
        token as vLLM's does: draft steps keep no activations and run the same
        graphs, so more passes measure nothing new and cost minutes of CPU
        start-up at 18-25 speculative tokens. The runner's flags pass through
        unchanged (docs/gpu-runner-reading.md)."""
        configured = self.num_speculative_tokens
        self.num_speculative_tokens = 1
        try:
            super().dummy_run(num_tokens, use_cudagraphs, is_graph_capturing,
                              slot_mappings=slot_mappings)
        finally:
            self.num_speculative_tokens = configured

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
            self.forward_times = self._time_forwards()

    def timed_at_start_up(self) -> dict:
        """What `time_costs` holds (None where nothing was timed)."""
        return {"forward_times": None if self.forward_times is None
                else self.forward_times.describe()}

    def _time_forwards(self) -> ForwardTimes:
        """The profiling-mode forward times: every rank runs the timing
        forwards (they hold tensor-parallel collectives); rank 0's numbers are
        the ones all ranks use."""
        from vllm.distributed import get_tp_group

        from vllm_selfspec.workers.profiling import time_forwards

        return get_tp_group().broadcast_object(
            time_forwards(self.runner, self, self.num_speculative_tokens), src=0)

    def prior_at(self, batch_size: int) -> StepCosts:
        """The stand-in costs at `batch_size` (`ForwardTimes.prior_at`)."""
        return self.forward_times.prior_at(batch_size, self.num_speculative_tokens)

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
        no drafts (no spec-decode metadata: patches.py gives a batch without
        drafts none), decide this round on the host alone and, when it drafts
        nothing, finish it here, so the glue is not paid either; a round that
        drafts goes on to `propose` with the decision made. False at once after
        a forward that verified drafts (their feedback comes first) or with
        lookup (it needs the sampled tokens): `propose` decides."""
        self._early = None  # a decision is for its own round only
        if spec_decode_metadata is not None:
            return False  # drafts were verified: feedback first
        if self.options.lookup and not self._closed(
                len(self.runner.input_batch.req_ids), self.counters.rounds + 1):
            return False  # lookup needs the sampled tokens: `propose` decides
        if self._repeat_decline(num_tokens):
            return True
        started = time.perf_counter()
        req_ids = list(self.runner.input_batch.req_ids)
        self._verified_drafts = None
        self._start_round(req_ids, None, num_tokens, started)
        decision = self._decide(req_ids, num_speculative_tokens, self._may_draft(req_ids))
        if decision is None:
            self._previous_round = RoundTiming(req_ids, 0, started, time.perf_counter())
            return True
        self._early = (started, decision)
        return False

    def _repeat_decline(self, num_tokens: int) -> bool:
        """Decline again without deciding, in a round `_decide` showed must
        decline as the one before did: the same requests, each decoding one
        token, nothing verified (so only the records' idle forgetting moved,
        whose retry waits for the next decision), and before the next probe or
        cost update. Deciding touches a few hundred Python
        objects, each a cache miss after the forward streamed the weights
        (~0.1 ms on the CPU); this touches a few."""
        previous = self._previous_round
        if (self.counters.rounds + 1 >= self._quiet_until
                or num_tokens != len(previous.req_ids)
                or not self._same_requests(self.runner.input_batch.req_ids)):
            return False
        started = time.perf_counter()
        self._time_previous_round(previous.req_ids, None, num_tokens, started)
        self.counters.rounds += 1
        self._previous_round = RoundTiming(previous.req_ids, 0, started, time.perf_counter())
        return True

    def _same_requests(self, req_ids: list[str]) -> bool:
        """The previous round's batch, and vLLM holds as many requests as when
        finished requests' state was last dropped."""
        previous = self._previous_round
        return (previous is not None and previous.req_ids == req_ids
                and len(self.runner.requests) == self._held_requests)

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
        drafts = torch.full((batch_size, num_speculative_tokens), NO_DRAFT,
                            dtype=torch.int64, device=self.device)
        rows: list[int] = []  # the rows whose drafts are looked up
        if self._early is not None:  # decided in `decline_early`: it drafts
            (started, decision), self._early = self._early, None
        else:
            started = time.perf_counter()
            verified, self._verified_drafts = self._verified_drafts, None
            self._start_round(req_ids, verified, target_token_ids.shape[0], started)
            accepted_now = self._take_feedback(req_ids, verified, num_rejected_tokens_gpu)
            self._score_previous_round(req_ids, verified, target_token_ids.shape[0],
                                       started, accepted_now)
            may_draft = self._may_draft(req_ids)
            costs = (self._timed_costs(req_ids, num_speculative_tokens)
                     if self.options.lookup else None)
            if costs is not None:
                rows = self.draft_by_lookup(req_ids, target_token_ids, next_token_ids,
                                            common_attn_metadata, accepted_now, drafts, costs)
                for row in rows:
                    may_draft[row] = False
            self.note_lookups(req_ids, [req_ids[row] for row in rows])
            decision = self._decide(req_ids, num_speculative_tokens, may_draft)
        steps = 0
        if decision is not None:
            steps = self._draft_loop(
                drafts, req_ids, decision, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, num_rejected_tokens_gpu, sampling_metadata)
        self._previous_round = RoundTiming(req_ids, steps, started, time.perf_counter(),
                                           bool(rows))
        return drafts

    def skip_round(self) -> None:
        """A step whose drafter vLLM did not run (some request's length plus
        k would pass max_model_len; vLLM then fills every row with token 0,
        which the runner hook drops): no request drafts, the drafts the forward
        verified give no feedback, and no round is timed across it."""
        self._verified_drafts = None
        self._previous_round = None
        self._early = None
        self.note_lookups(list(self.runner.input_batch.req_ids), [])

    def _start_round(self, req_ids: list[str], verified: list[int] | None,
                     num_tokens: int, started: float) -> None:
        """Time the round that just ended, drop the state of requests vLLM no
        longer holds (looked at only when the batch or the held set changed),
        and count this round."""
        self._time_previous_round(req_ids, verified, num_tokens, started)
        if not self._same_requests(req_ids):
            live = set(self.runner.requests)
            self.self_records.forget(live)
            self.lookup_records.forget(live)
            self.looked_up &= live
            self.forget_finished(live)
            self._held_requests = len(live)
        self.counters.rounds += 1

    def _take_feedback(self, req_ids: list[str], verified: list[int] | None,
                       num_rejected_tokens_gpu: torch.Tensor | None) -> dict[str, int]:
        """Acceptance records from the drafts the forward verified; returns
        each verified request's accepted count."""
        accepted_now: dict[str, int] = {}
        if num_rejected_tokens_gpu is None or verified is None:
            return accepted_now
        # The engine's, self-drafts and lookups apart: accepted, rejections.
        round_counts = {False: [0, 0], True: [0, 0]}  # by looked_up
        for req_id, accepted, scheduled in verified_feedback(
                req_ids, verified, num_rejected_tokens_gpu.tolist()):
            accepted_now[req_id] = accepted
            looked_up = req_id in self.looked_up
            records = self.lookup_records if looked_up else self.self_records
            records.add_request_round(req_id, accepted, scheduled, self.counters.rounds)
            counts = round_counts[looked_up]
            counts[0] += accepted
            counts[1] += int(accepted < scheduled)
            if not looked_up:
                self.observe_round(req_id, accepted, scheduled)
        self.self_records.add_engine_round(*round_counts[False])
        self.lookup_records.add_engine_round(*round_counts[True])
        return accepted_now

    def note_lookups(self, req_ids: list[str], looked_up: list[str]) -> None:
        """Which of this round's requests drafted by lookup. A request vLLM
        leaves out of a step (the token budget) keeps its drafts for a later
        one, so its note stays until it is in a round again: its feedback
        then goes to the record of the drafts it had."""
        self.looked_up.difference_update(req_ids)
        self.looked_up.update(looked_up)

    def _may_draft(self, req_ids: list[str]) -> list[bool]:
        """Per request: it has a token to continue from. One whose prompt is
        still prefilling in chunks has none yet (vLLM discards its sample)."""
        return (~self.runner.discard_request_mask.np[:len(req_ids)]).tolist()

    def _timed_costs(self, req_ids: list[str],
                     num_speculative_tokens: int) -> StepCosts | None | bool:
        """This round's costs when cost-aware (None: it times a plain step and
        drafts nothing, not even a lookup), False when not cost-aware. Runs once
        per round: sharing the costs is a tensor-parallel collective."""
        if not self.options.cost_aware:
            return False
        if self._round_costs is None or self._round_costs[0] != self.counters.rounds:
            self._round_costs = (self.counters.rounds,
                                 self.round_costs(len(req_ids)))
        return self._round_costs[1]

    def _decide(self, req_ids: list[str], num_speculative_tokens: int,
                may_draft: list[bool]) -> DraftDecision | None:
        """How many draft steps this round runs and which requests draft, on
        host lists alone (a round that drafts nothing does no device work);
        None when it drafts nothing."""
        self._quiet_until = 0
        costs = self._timed_costs(req_ids, num_speculative_tokens)
        if costs is None:
            return None
        steps, budgets, all_may_draft = num_speculative_tokens, None, all(may_draft)
        if costs is not False:
            rounds = self.counters.rounds
            interval = probe_interval(costs, self.options.probe_every, PROBE_SHARE)
            probe = rounds % interval == 0
            budgets, acceptances = self.self_records.budgets(
                req_ids, costs, num_speculative_tokens, MIN_GAIN, probe, rounds)
            budgets = [b if row_drafts else 0 for b, row_drafts in zip(budgets, may_draft)]
            may_draft = [b > 0 for b in budgets]
            steps = batch_steps(acceptances, budgets, costs, len(req_ids), MIN_GAIN)
            if probe and any(budgets):
                steps = max(steps, 1)  # idle requests probe even where the batch would not
            if steps == 0 and all_may_draft and self.shared_costs and rounds % SHARE_EVERY:
                # Until the next probe or cost update, the same requests without
                # feedback decline again (`_repeat_decline`); only their records'
                # idle forgetting moves meanwhile, so a retry waits for that round.
                self._quiet_until = min((rounds // interval + 1) * interval,
                                        (rounds // SHARE_EVERY + 1) * SHARE_EVERY)
        if steps == 0 or not any(may_draft):
            return None
        return DraftDecision(steps, may_draft, budgets)

    def _draft_loop(self, drafts: torch.Tensor, req_ids: list[str], decision: DraftDecision,
                    target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                    target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                    token_indices_to_sample: torch.Tensor | None,
                    common_attn_metadata: CommonAttentionMetadata,
                    num_rejected_tokens_gpu: torch.Tensor | None,
                    sampling_metadata: SamplingMetadata) -> int:
        """Run the decided draft steps, writing `drafts` (and, for sampled
        requests, the drafts' distribution: `workers/draft_sampling.py`);
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
        # Only a round that self-drafts pays for the method's look at the
        # forward (DEL's shadow tokens, SWIFT's search): a declined round
        # costs what a plain step costs.
        self.begin_round(req_ids, VerifiedTokens(
            target_token_ids, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata.query_start_loc[:batch_size],
            target_positions, common_attn_metadata))
        positions = target_positions[token_indices_to_sample]
        cad = self._decode_metadata(common_attn_metadata, num_rejected_tokens_gpu)
        # The round's tokens so far: the sampled token, then each step's draft.
        round_tokens = next_token_ids.view(batch_size, 1)
        steps_run = 0
        for step in range(decision.steps):
            if budgets is not None:
                drafting &= budget > step
            steps_run += 1
            positions = self._advance(positions, cad, batch_size)
            logits, is_draft = self.draft_step(round_tokens, positions, cad, step, drafting)
            # One float copy for the argmax and the methods' confidence: over
            # bf16 logits the CPU's argmax is a scalar loop, 4x the float one.
            logits = logits.float()
            token_ids = (logits.argmax(dim=-1) if sampler is None
                         else sampler.sample(logits, positions))
            round_tokens = torch.cat([round_tokens, token_ids.view(batch_size, 1)], dim=1)
            if is_draft is not None:
                drafting &= is_draft
            # Rows not drafting keep what they have (NO_DRAFT, or a lookup draft).
            drafts[:, step] = torch.where(drafting, token_ids, drafts[:, step])
            if sampler is not None:
                sampler.keep(step, drafting)
            stop = self.stop_after(req_ids, logits, step)
            if stop is not None:
                drafting &= ~stop
            if (is_draft is not None or stop is not None) and not bool(drafting.any()):
                break
        if sampler is not None:
            self._last_draft_probs = sampler.round_probs(drafts)
        return steps_run

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata,
                              valid_sampled_tokens_count):
        """vLLM's, noting how many drafts it scheduled per request: only those
        were verified (budget and structured-output trims, chunked prefill drop
        the rest), so only those become acceptance feedback. (A batch without
        drafts has no spec-decode metadata and does not come here, except on a
        hybrid model, which keeps vLLM's metadata: patches.py.)"""
        self._verified_drafts = list(spec_decode_metadata.num_draft_tokens)
        return super().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata,
                                             valid_sampled_tokens_count)

    # --- lookup drafts ---------------------------------------------------------
    def draft_by_lookup(self, req_ids: list[str], step_tokens: torch.Tensor,
                        next_token_ids: torch.Tensor, cad: CommonAttentionMetadata,
                        accepted: dict[str, int], drafts: torch.Tensor,
                        costs: StepCosts | Literal[False]) -> list[int]:
        """Fill `drafts` for the requests whose own text offers a match
        (workers/lookup.py); returns their rows."""
        from vllm_selfspec.workers.lookup import lookup_draft, request_tokens

        batch = self.runner.input_batch
        discarded = self.runner.discard_request_mask.np
        tokens, next_ids = step_tokens.tolist(), next_token_ids.tolist()
        first_rows = cad.query_start_loc_cpu.tolist()
        max_model_len = self.vllm_config.model_config.max_model_len
        lengths = self.lookup_lengths(req_ids, costs, min(drafts.shape[1],
                                                          self.options.lookup["max_tokens"]))
        rows = []
        for row, req_id in enumerate(req_ids):
            if discarded[row] or not lengths[row]:
                continue
            context = request_tokens(
                batch.token_ids_cpu[row, :batch.num_tokens_no_spec[row]], tokens,
                first_rows[row], accepted.get(req_id, 0), next_ids[row])
            found = lookup_draft(context, self.options.lookup["min_match"],
                                 self.options.lookup["max_match"], max_model_len,
                                 lengths[row])
            if len(found):
                drafts[row, :len(found)] = torch.from_numpy(found).to(drafts.device)
                rows.append(row)
        return rows

    def lookup_lengths(self, req_ids: list[str], costs: StepCosts | Literal[False],
                       max_tokens: int) -> list[int]:
        """The most tokens each request's lookup may draft this round: when
        cost-aware, the length its own lookups' acceptance record makes worth
        their verification (a looked-up token runs no draft step, so in text
        that copies long spans this grows to `max_tokens`, and in text whose
        matches soon part from the target's it stays short), 0 where no
        length pays (that request then self-drafts or not, as decided for
        it), and 1 instead of 0 on a probe round, so the record recovers.
        Without cost-aware drafting, `max_tokens`."""
        if costs is False:
            return [max_tokens] * len(req_ids)
        lookup_costs = costs.for_lookup(len(req_ids))
        probe = self.counters.rounds % probe_interval(
            lookup_costs, self.options.probe_every, PROBE_SHARE) == 0
        return self.lookup_records.budgets(req_ids, lookup_costs, max_tokens, MIN_GAIN,
                                           probe, self.counters.rounds)[0]

    # --- cost-aware drafting -------------------------------------------------
    def round_costs(self, batch_size: int) -> StepCosts | None:
        """This round's costs from the engine's timed rounds, the same on every
        tensor-parallel rank (rank 0's, shared on the round clock); None when
        this round should draft nothing to time a plain step (none timed yet,
        none at a batch size of this one's bucket, or the newest is old)."""
        from vllm.distributed import get_tp_group

        rounds = self.counters.rounds
        tp = get_tp_group()
        if self.forward_times is None:  # not timed at start-up (e.g. cost_aware switched on)
            self.forward_times = self._time_forwards()
        # Which rounds share, and the clock's keys and round indices, are alike
        # on every rank; only rank 0's timings are used.
        ready = self.clock.plain_rounds() >= PLAIN_ROUNDS_FIRST
        if ready and (rounds % SHARE_EVERY == 0 or not self.shared_costs):
            shared = ((self.clock.costs(self.prior_at), self.gate.closed())
                      if tp.rank_in_group == 0 else None)
            self.shared_costs, self.shared_closed = tp.broadcast_object(shared, src=0)
        if self._closed(batch_size, rounds):
            return None
        if not self.shared_costs:
            return self.prior_at(batch_size) if rounds >= NOT_STEADY_ROUNDS else None
        if (rounds % SHARE_EVERY == 1
                and self.clock.fresh_plain_rounds(rounds) < PLAIN_ROUNDS_FIRST):
            return None  # the newest plain times are stale
        return costs_for(self.shared_costs, batch_size)

    def _closed(self, batch_size: int, rounds: int) -> bool:
        """Round `rounds` drafts nothing: cost-aware, its batch's bucket is
        closed (its drafting rounds were not measured to beat plain ones by the
        gate's margin) and this is not one of the bucket's tries
        (`reopen_interval`)."""
        ratio = self.shared_closed.get(batch_bucket(batch_size))
        return (bool(self.options.cost_aware) and ratio is not None
                and rounds % reopen_interval(ratio, self.options.probe_every,
                                             PROBE_SHARE) != 0)

    def _score_previous_round(self, req_ids: list[str], verified: list[int] | None,
                              num_tokens: int, started: float,
                              accepted_now: dict[str, int]) -> None:
        """Score the round that just ended in the goodput gate, if it verified
        drafts and was steady (the same requests as the one before, no prefill
        in the forward) and a plain round of its batch is timed: from the start
        of its drafting to now, it yielded each request's token and the drafts
        accepted."""
        previous = self._steady_previous_round(req_ids, verified, num_tokens)
        if previous is None or not sum(verified or ()):
            return
        plain = self.clock.plain_seconds_at(len(req_ids))
        if plain is not None:
            self.gate.record(len(req_ids), len(req_ids) + sum(accepted_now.values()),
                             started - previous.started, plain)

    def _steady_previous_round(self, req_ids: list[str], verified: list[int] | None,
                               num_tokens: int) -> RoundTiming | None:
        """The round that just ended, if it was steady: the same requests as
        the one before, and a forward of one token per request plus the
        drafts it verified (no prefill)."""
        previous = self._previous_round
        if (previous is None or previous.req_ids != req_ids
                or num_tokens != len(req_ids) + sum(verified or ())):
            return None
        return previous

    def _time_previous_round(self, req_ids: list[str], verified: list[int] | None,
                             num_tokens: int, started: float) -> None:
        """Time the round that just ended into the clock, if it was steady."""
        previous = self._steady_previous_round(req_ids, verified, num_tokens)
        if previous is None:
            return
        drafts_verified = sum(verified or ())
        if drafts_verified > 0 and previous.looked_up and previous.steps == 0:
            self.clock.record_looked_up(len(req_ids), drafts_verified, started - previous.started,
                                        self.counters.rounds)
        elif drafts_verified > 0 and previous.steps > 0 and not previous.looked_up:
            # (A round whose drafts all stopped before step 1 verified nothing;
            # a round that both looked up and self-drafted is timed as neither.)
            self.clock.record_drafted(len(req_ids), previous.steps, started - previous.started,
                                      self.counters.rounds)
        elif drafts_verified == 0:
            self.clock.record_plain(len(req_ids), started - previous.ended,
                                    self.counters.rounds)

    # --- the draft loop's pieces ---------------------------------------------
    def _decode_metadata(
        self,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> CommonAttentionMetadata:
        """One query token per request, ending at its last accepted token."""
        batch_size = cad.batch_size()
        seq_lens = cad.seq_lens
        if num_rejected_tokens_gpu is not None:
            seq_lens = seq_lens - num_rejected_tokens_gpu
        return cad.replace(
            seq_lens=seq_lens.clone(),
            num_actual_tokens=batch_size,
            max_query_len=1,
            query_start_loc=self.arange[: batch_size + 1],
            query_start_loc_cpu=torch.from_numpy(
                self.token_arange_np[: batch_size + 1]
            ).clone(),
            positions=None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of each request's next draft, and which of them are drafts
        (None: all). Default: the newest token through the layer plan."""
        batch_size = round_tokens.shape[0]
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=step
        )
        self.input_ids[:batch_size] = round_tokens[:, -1]
        with self.draft_forward_context(per_layer_metadata, batch_size,
                                        self._get_slot_mapping(batch_size)):
            hidden_states = self.model(
                input_ids=self.input_ids[:batch_size],
                positions=self._get_positions(batch_size),
            )
        plan = self.model.plan
        self.counters.add_step(plan.fraction_run * plan.num_layers)
        return self.model.compute_logits(hidden_states[:batch_size]), None

    def window_metadata(
        self, cad: CommonAttentionMetadata, positions: torch.Tensor, width: int
    ) -> tuple[CommonAttentionMetadata, torch.Tensor]:
        """`cad` (one query token per request, at `positions`) widened to the
        `width` tokens ending there; returns it and their flat positions."""
        batch_size = positions.shape[0]
        offsets = torch.arange(1 - width, 1, device=positions.device)
        window = (positions.view(-1, 1) + offsets).clamp(min=0).view(-1)
        rows = torch.arange(batch_size, device=positions.device).repeat_interleave(width)
        blocks = cad.block_table_tensor[rows, window // self.block_size]
        slots = (blocks.long() * self.block_size + window % self.block_size).view(-1, width)
        # The newest token's slot as `_advance` set it (padding past max_model_len).
        slots[:, -1] = cad.slot_mapping[:batch_size]
        slots = slots.view(-1)
        starts = self.arange[: batch_size + 1] * width
        widened = cad.replace(
            query_start_loc=starts,
            query_start_loc_cpu=torch.from_numpy(
                self.token_arange_np[: batch_size + 1] * width),
            num_actual_tokens=batch_size * width,
            max_query_len=width,
            slot_mapping=slots,
            positions=window,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return widened, window

    def request_window(
        self, cad: CommonAttentionMetadata, row: int, start: int, width: int
    ) -> tuple[CommonAttentionMetadata, torch.Tensor]:
        """Metadata for one request's `width` tokens from position `start`, as
        a causal query over its KV (row `row` of `cad`'s block table); the slot
        mapping is a placeholder: callers read the cache and write nothing."""
        positions = torch.arange(start, start + width, device=self.device)
        seq_len = start + width
        window = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, width], dtype=torch.int32, device=self.device),
            query_start_loc_cpu=torch.tensor([0, width], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=self.device),
            num_reqs=1,
            num_actual_tokens=width,
            max_query_len=width,
            max_seq_len=seq_len,
            block_table_tensor=cad.block_table_tensor[row:row + 1],
            slot_mapping=torch.full((width,), -1, dtype=torch.int64, device=self.device),
            positions=positions,
            seq_lens_cpu_upper_bound=torch.tensor([seq_len], dtype=torch.int32),
        )
        return window, positions


def _cpu_warm_up_skipped() -> bool:
    """vLLM's CPU worker ran no profiling forward before the KV cache
    (`CPUWorker._should_warm_up_model`: its CI switch)."""
    from vllm import envs
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and envs.VLLM_CPU_CI_ENV


def verified_feedback(req_ids: list[str], verified: list[int], rejected: list[int]
                      ) -> list[tuple[str, int, int]]:
    """(request, accepted, verified) for each request that had drafts verified
    in the forward that just ran: vLLM reports 0 rejected for a request whose
    drafts it did not schedule, which must not count as accepted."""
    return [(req_id, max(scheduled - num_rejected, 0), scheduled)
            for req_id, scheduled, num_rejected in zip(req_ids, verified, rejected)
            if scheduled > 0]
