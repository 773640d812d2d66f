"""The replacements that `integration/patches.py` installs into vLLM, each a few lines."""

from __future__ import annotations

from typing import Any, get_args

from vllm_selfspec.config import METHOD_MODULES, SelfSpecConfig, SelfSpecConfigError, check_keys
from vllm_selfspec.draft.tokens import NO_DRAFT
from vllm_selfspec.integration.frame_stack import with_frame_room
from vllm_selfspec.integration.patches import original
from vllm_selfspec.proposers import config_class_for, method_module


def _vllm_methods() -> set[str]:
    from vllm.config.speculative import MTPModelTypes, SpeculativeMethod

    return set(get_args(SpeculativeMethod)) | set(get_args(MTPModelTypes))


def speculative_config_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """SpeculativeConfig(method=<ours>, ...) builds that method's subclass."""
    from vllm.config.speculative import SpeculativeConfig

    method = kwargs.get("method")
    if cls is SpeculativeConfig and isinstance(method, str):
        if method in METHOD_MODULES:
            cls = config_class_for(method)
            check_keys(cls, kwargs)
        elif method not in _vllm_methods():
            raise SelfSpecConfigError(
                f"speculative_config.method: unknown method '{method}'; use one of "
                f"vllm-selfspec's {sorted(METHOD_MODULES)} or one of vLLM's "
                f"{sorted(_vllm_methods())}."
            )
    return object.__new__(cls)


def draft_model_proposer_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """DraftModelProposer(vllm_config=<ours>) builds that method's proposer."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    spec = getattr(vllm_config, "speculative_config", None)
    if cls is DraftModelProposer and isinstance(spec, SelfSpecConfig):
        cls = method_module(spec.method).PROPOSER_CLASS
    return object.__new__(cls)


def take_draft_token_ids(self: Any) -> Any:
    """Cut each request's drafts at the first NO_DRAFT before scheduling, and
    say where each came from (integration/token_sources.py)."""
    from vllm_selfspec.integration.token_sources import SourcedDraftTokenIds

    drafts = original(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "take_draft_token_ids"
    )(self)
    if drafts is None or not isinstance(getattr(self, "speculative_config", None),
                                        SelfSpecConfig):
        return drafts
    if not self.drafter.proposed_this_step:
        # vLLM skipped the drafter (a request's length plus k would pass
        # max_model_len) and filled every row with token 0: no request drafts.
        return SourcedDraftTokenIds(drafts.req_ids, [[] for _ in drafts.req_ids],
                                    [""] * len(drafts.req_ids))
    rows = [
        row[: row.index(NO_DRAFT)] if NO_DRAFT in row else row
        for row in drafts.draft_token_ids
    ]
    return SourcedDraftTokenIds(drafts.req_ids, rows,
                                self.drafter.draft_sources(drafts.req_ids, rows))


def v2_runner_unsupported_features(self: Any) -> list[str]:
    unsupported = original(
        "vllm.config.vllm", "VllmConfig", "_get_v2_model_runner_unsupported_features"
    )(self)
    if isinstance(self.speculative_config, SelfSpecConfig):
        unsupported.append(
            f"speculative method '{self.speculative_config.method}' "
            "(vllm-selfspec drafts through the V1 runner's proposer hook)"
        )
    return unsupported


def aux_hidden_state_layers(self: Any) -> tuple[int, ...] | None:
    """The layers whose hidden states the target returns to the drafter."""
    layers = getattr(getattr(self, "drafter", None), "aux_hidden_state_layers", None)
    if layers is not None:
        return layers()
    return original(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
        "_get_eagle3_aux_layers_from_config")(self)


def quantize_linear_before_packing(self: Any, layer: Any) -> None:
    """With a low-precision draft configured, make the draft's copy of each
    unquantized linear weight while the weight is still there: vLLM's CPU
    path packs it into oneDNN and frees the tensor right after."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    from vllm_selfspec.draft.weights import stash_low_precision_copy

    config = get_current_vllm_config_or_none()
    spec = getattr(config, "speculative_config", None)
    if isinstance(spec, SelfSpecConfig):
        stash_low_precision_copy(layer, spec.draft_precision, config.model_config.dtype)
    original("vllm.model_executor.layers.linear", "UnquantizedLinearMethod",
             "process_weights_after_loading")(self, layer)


# The step's drafts ride on the worker's ModelRunnerOutput under this name, so
# the engine core does not send the worker a second message to ask for them.
SHIPPED_DRAFTS = "selfspec_draft_token_ids"


def sample_tokens_with_drafts(self: Any, grammar_output: Any) -> Any:
    """vLLM's, with the drafts this step proposed on the output it returns:
    `EngineCore.post_step` would otherwise ask for them in a message round
    trip of its own. Drafting
    runs here, so it gets the frame room `execute_model` gets. A step whose
    forward ran but whose drafter vLLM skipped (max_model_len) is a round that
    never happened for the proposer (`skip_round`)."""
    stepped = (isinstance(getattr(self, "speculative_config", None), SelfSpecConfig)
               and self.execute_model_state is not None)  # a forward ran
    if stepped:
        self.drafter.proposed_this_step = False  # set by `propose_or_decline`
    output = with_frame_room(original(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"
    ), self, grammar_output)
    if stepped and not self.drafter.proposed_this_step:
        self.drafter.skip_round()
    return ship_drafts(self, output)


def execute_model_with_frame_room(self: Any, scheduler_output: Any,
                                  intermediate_tensors: Any = None) -> Any:
    """vLLM's, under a frame with room for the compiled graph's Python op
    calls (`integration/frame_stack.py`), in every engine: plain vLLM's steps
    map a chunk per op call too, so the plugin's speed-ups are not this."""
    return with_frame_room(original(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"
    ), self, scheduler_output, intermediate_tensors)


def ship_drafts(runner: Any, output: Any) -> Any:
    """`output` with the runner's drafts on it, when one of our methods runs
    without async scheduling (whose drafts stay in the worker) and `output`
    is a step's own (not vLLM's shared empty output)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if (isinstance(runner.speculative_config, SelfSpecConfig)
            and not runner.use_async_scheduling and type(output) is ModelRunnerOutput
            and output is not EMPTY_MODEL_RUNNER_OUTPUT):
        setattr(output, SHIPPED_DRAFTS, runner.take_draft_token_ids())
    return output


def keep_shipped_drafts(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
    """vLLM's, keeping the drafts that came with the output for `post_step`."""
    if hasattr(model_runner_output, SHIPPED_DRAFTS):
        self.selfspec_shipped_drafts = getattr(model_runner_output, SHIPPED_DRAFTS)
    return original("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output")(
        self, scheduler_output, model_runner_output)


def post_step_with_shipped_drafts(self: Any, model_executed: bool) -> None:
    """vLLM's post-step, taking shipped drafts instead of asking the worker
    (the same drafts: the worker has done nothing since it sent them)."""
    shipped = vars(self.scheduler)
    if "selfspec_shipped_drafts" not in shipped:
        original("vllm.v1.engine.core", "EngineCore", "post_step")(self, model_executed)
        return
    drafts = shipped.pop("selfspec_shipped_drafts")
    if (drafts is not None and self.check_for_draft_tokens and not self.async_scheduling
            and model_executed):
        self.scheduler.update_draft_token_ids(drafts)


def propose_or_decline(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                       sampling_metadata: Any, hidden_states: Any, sample_hidden_states: Any,
                       aux_hidden_states: Any, spec_decode_metadata: Any,
                       common_attn_metadata: Any, slot_mappings: Any) -> Any:
    """vLLM's, unless our proposer declines the round before vLLM's drafting
    glue runs: then no request drafts, said
    with an empty draft list per request. Synchronous scheduling only: with
    async scheduling the next step reads the glue's device tensors."""
    if isinstance(self.speculative_config, SelfSpecConfig):
        self.drafter.proposed_this_step = True
    if (isinstance(self.speculative_config, SelfSpecConfig) and not self.use_async_scheduling
            and self.drafter.decline_early(scheduler_output.num_spec_tokens_to_schedule,
                                           scheduler_output.total_num_scheduled_tokens,
                                           spec_decode_metadata)):
        return [[] for _ in self.input_batch.req_ids]
    return original("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
                    "propose_draft_token_ids")(
        self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
        sample_hidden_states, aux_hidden_states, spec_decode_metadata,
        common_attn_metadata, slot_mappings)


def prepare_inputs_without_drafts(self: Any, scheduler_output: Any,
                                  num_scheduled_tokens: Any) -> Any:
    """vLLM's, preparing a batch that carries no draft as plain vLLM does:
    once speculation is configured vLLM builds spec-decode metadata for every
    batch, and with it the rejection
    sampler and the drafting glue's verification path run for nothing. Without
    it (None, as for plain vLLM) the step samples with the plain sampler.
    Hybrid models read the speculative rows' offsets: they keep vLLM's path."""
    prepare = original("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs")
    spec = self.speculative_config
    if (not isinstance(spec, SelfSpecConfig) or self.model_config.is_hybrid
            or any(scheduler_output.scheduled_spec_decode_tokens.values())):
        return prepare(self, scheduler_output, num_scheduled_tokens)
    # `_prepare_inputs` reads the speculative config once, to choose this.
    self.speculative_config = None
    try:
        return prepare(self, scheduler_output, num_scheduled_tokens)
    finally:
        self.speculative_config = spec
