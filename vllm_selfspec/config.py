"""Speculative configs of the self-speculative methods.

vLLM's `SpeculativeConfig` forbids unknown methods and keys, so each method has
a subclass of it (declared in its own module under `proposers/`) and the
plugin routes `SpeculativeConfig(method=<ours>, ...)` to that subclass. The
subclass reports `uses_draft_model()`, which makes vLLM reserve lookahead KV
slots, run the drafter on the sampled-token tensor, and build our proposer
where it would build a draft-model proposer (see `integration/patches.py`).

This module imports only vLLM and `assets.py` of the plugin: the bottom layer.
What needs the draft's modules (choosing and checking the draft's weights and
vocabulary for the target) is `draft/choice.py`, the base of every method's
config class; `proposers/__init__.py` maps a method's name to its classes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, get_type_hints

from pydantic import TypeAdapter, ValidationError
from vllm.config import SpeculativeConfig
from vllm.config.utils import config

from vllm_selfspec.assets import CONFIGS_DIR

# method name -> module that defines its config class and proposer class.
METHOD_MODULES = {
    "draft_verify": "vllm_selfspec.proposers.draft_verify",
    "adadecode": "vllm_selfspec.proposers.adadecode",
    "del": "vllm_selfspec.proposers.dynamic_exit",
    "swift": "vllm_selfspec.proposers.swift",
}

# Architectures whose decoder layers the draft engine knows how to run.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


DRAFT_PRECISIONS = ("auto", "target", "int8", "int4")
# On a GPU, "auto" makes an int8 copy only where it takes at most this share
# of the device's memory (the rest is the KV cache's).
GPU_COPY_SHARE = 0.10


class SelfSpecConfigError(ValueError):
    """A self-speculative config that cannot work; the message names the field."""


@dataclasses.dataclass(frozen=True, eq=False)
class Option:
    """A setting's default and the range of values it takes, declared with its
    field (`name: Annotated[type | None, Option(default, ge=...)] = None`):
    the one place both are stated. The field itself defaults to None, which
    means "not given", so that a config file fills only what the user left
    unset; then the default applies and the value is checked."""

    default: Any = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    # What the key means, for keys inside a dict-valued field (lookup's), which
    # have no docstring of their own.
    doc: str = ""

    def check(self, name: str, value: Any) -> None:
        """Raise, naming the field, if a number lies outside the range."""
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        low_ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt))
        high_ok = ((self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        if low_ok and high_ok:
            return
        low = self.ge if self.gt is None else self.gt
        high = self.le if self.lt is None else self.lt
        if low is not None and high is not None:
            bounds = (f"{'[' if self.gt is None else '('}{low}, {high}"
                      f"{']' if self.lt is None else ')'}")
            wrong = f"is outside {bounds}"
        elif low is not None:
            wrong = f"must be {'>=' if self.gt is None else '>'} {low}"
        else:
            wrong = f"must be {'<=' if self.lt is None else '<'} {high}"
        default = "" if self.default is None else f"; the default is {self.default!r}"
        raise SelfSpecConfigError(f"speculative_config.{name}: {value} {wrong}{default}.")


def _field_names(cls: type) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


LOOKUP_SOURCES = ("ngram", "suffix")
# A lookup draft is at most `max_tokens` long (and at most the method's
# num_speculative_tokens): its tokens cost no draft step but each is verified.
# Cost-aware drafting sizes each request's lookups by their record below that
# cap (`RoundPolicy.lookup_lengths`): long in text that copies long spans,
# short where a match's continuation soon parts from the target's
# (docs/results/batch1.md); a suffix draft is cut at the same costs by the
# acceptance of drafts found by matches as long, and where the trees'
# continuations branched. Without it every lookup may run to the cap.
# The suffix keys are vLLM's `suffix_decoding_*` defaults but for the cache of
# past responses, kept smaller: each holds up to max_model_len tokens.
LOOKUP_OPTIONS = {
    "source": Option("ngram", doc='Where drafts are looked up: "ngram", vLLM\'s matcher over '
                     "the request's own tokens; \"suffix\", Arctic Inference's suffix trees "
                     "over the request and the engine's past responses (needs arctic-inference)."),
    "min_match": Option(2, ge=1, doc="ngram: the fewest of a request's last tokens that must "
                        "have occurred before."),
    "max_match": Option(8, ge=1, doc="ngram: the most of its last tokens matched (the longest "
                        "match wins)."),
    "max_tokens": Option(12, ge=1, doc="The most tokens one lookup drafts."),
    "max_tree_depth": Option(24, ge=1, doc="suffix: the most of a request's last tokens matched "
                             "(the trees' depth)."),
    "max_cached_requests": Option(1000, ge=0, doc="suffix: past responses kept for other "
                                  "requests to draft from, the oldest evicted first (0: none, "
                                  "only the request's own text)."),
    "max_spec_factor": Option(1.0, ge=0, doc="suffix: a draft is at most this many times the "
                              "matched length."),
    "min_token_prob": Option(0.1, ge=0, le=1, doc="suffix: the least estimated probability of a "
                             "drafted token."),
}
LOOKUP_DEFAULTS = {key: option.default for key, option in LOOKUP_OPTIONS.items()}


@config
class SelfSpecConfig(SpeculativeConfig):
    """Fields and checks shared by every self-speculative method."""

    config_file: str | None = None
    """JSON settings for a model (a path, or a name under
    `vllm_selfspec/configs/`), such as a searched skip set; keys given directly
    win over the file's. The file holds `num_hidden_layers`, checked against
    the target, and `methods.<method>.<key>`."""
    draft_precision: Annotated[str | None, Option("auto")] = None
    """Weights the draft reads: "auto", "target" (the target's own), "int8" (a
    W8A8 copy) or "int4" (a W4A16 copy); verification always uses the
    target's own, so outputs stay the target's. "auto" is a low-precision copy
    where this platform's kernels make it pay, logged at start-up with the
    reason: "int8" on a CPU; on a CUDA/ROCm GPU "int8" when the model runs in
    bf16/fp16 and the copy takes at most a tenth of the device's memory (the
    rest stays the KV cache's; a 70B model's copy is 70 GB), else "target";
    "target" for an already quantised model and on other platforms. The int8
    copy covers every linear the draft runs, made from the loaded weights at
    start-up (per-output-channel scales), through vLLM's int8 kernels (on the
    CPU the AMX sgl kernel where the CPU and shape allow, oneDNN otherwise; on
    CUDA CUTLASS), and on an x86 CPU without VNNI or AMX PyTorch's fbgemm
    dynamic int8 linear instead. The int4 copy is symmetric in groups of 64
    (vLLM's `cpu_gemm_wna16`, or its W4A8 `int4_scaled_mm_cpu` on AMX,
    Marlin/Machete on CUDA, PyTorch's int4 kernel where the build has
    neither; bf16/fp16 models; the draft head stays int8). Start-up logs the
    copy's size; under tensor parallelism each rank copies its own shard."""
    draft_vocab: Annotated[str | int | None, Option(ge=1)] = None
    """A draft LM head over a frequent-token subset: a vocabulary file (a
    path, or a name under `vllm_selfspec/configs/vocab/`), a size N (the top
    N tokens of the model's shipped file) or "full" (the whole vocabulary).
    Every LM-head pass of the draft uses it (drafts, AdaDecode's exits, DEL's
    shadow tokens, SWIFT's scoring); drafts never leave the subset, and
    verification uses the full head. Files are checked against the model like
    exit heads (vocabulary size, final-norm hash); the shipped file is found
    by the model's weights, and start-up logs which was taken. Default: the
    model's shipped file, else "full"."""
    draft_vocab_size: Annotated[int | None, Option(ge=1)] = None
    """How many of the vocabulary file's ranked tokens to keep. Default: the
    file's recommended size."""
    cost_aware: Annotated[bool | None, Option(True)] = None
    """Draft only what pays, per request and round, by the costs the engine
    times and each request's own acceptance; false: draft every round as the
    method says. Each request drafts the number of tokens that maximises its
    expected tokens per unit of time at the current batch size, none (plain
    decoding for it) where no number beats plain by 5 %; a batch-size bucket
    whose drafting rounds did not beat plain rounds' tokens per second by 5 %
    drafts nothing, lookups included, but for a try spaced to cost at most
    1 % of decoding. Tensor-parallel ranks use rank 0's measurements. How it
    works: docs/design.md, cost-aware drafting."""
    probe_every: Annotated[int | None, Option(16, ge=1)] = None
    """The fewest engine rounds between probes, on which requests that stopped
    drafting draft one token together, so they start again when their text
    turns predictable. Dear probes are spaced further, so that probes that
    find nothing cost at most 1 % of decoding."""
    draft_sample_method: str = "probabilistic"
    """How sampled requests' self-drafts are drawn (vLLM's key, with another
    default): "probabilistic" from the draft's own distribution, verified with
    it; "greedy" the argmax. Probabilistic drafts are accepted with
    min(1, p/q), nearly their greedy acceptance at any temperature; greedy
    ones with p. Both keep the target distribution; seeded requests draw
    drafts from their seed and position; lookup drafts are one-hot."""
    lookup: Annotated[dict[str, int | float | str] | bool | None, Option({})] = None
    """Free drafts first, copied from text already seen: a dict sets its
    keys (below), {} or true keeps their defaults, false turns lookups off.
    With source "ngram", when a request's last `min_match` to `max_match`
    tokens occurred earlier in its prompt or output, the tokens that followed
    there are its drafts this round (vLLM's own n-gram matcher); with
    "suffix", Arctic Inference's suffix trees over the request and the
    engine's past responses propose them. A request with a draft runs no
    self-draft; requests without one self-draft as usual, in the same batch.
    With cost_aware, as many (up to `max_tokens` and num_speculative_tokens)
    as the request's own lookups' acceptance makes worth verifying (suffix
    trees: as drafts found by matches as long were accepted, cut where the
    trees' past continuations branched); without it, `max_tokens`."""
    full_depth: Annotated[bool | None, Option(True)] = None
    """The full-depth draft over the same weights is the base a skip set or
    an early exit must beat. With cost_aware, a round drafts by the method's
    mechanism only where its measured acceptance and step cost beat the
    base's by 5 %, else at full depth (trial rounds of the other keep both
    measured; `policy/mechanism_gate.py`); false: the mechanism drafts every
    round. AdaDecode's base drafts every token no exit head is
    sure of, and each head drafts only while it pays (`policy/exit_gate.py`);
    false: such a token ends the request's drafts, and every head drafts, as
    in its paper. Draft & Verify without a skip set has no mechanism to
    weigh."""

    # Defaults a method module sets; None means "not given by the user".
    default_num_speculative_tokens: ClassVar[int] = 4

    def __post_init__(self) -> None:
        self._merge_config_file()
        if self.model is not None:
            raise SelfSpecConfigError(
                f"speculative_config.model: method '{self.method}' drafts with the "
                "target model itself; remove 'model'."
            )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.default_num_speculative_tokens
        self.prompt_lookup_max = 0
        self.prompt_lookup_min = 0
        self.draft_model_config = self.target_model_config
        self.draft_parallel_config = self.target_parallel_config
        for name, value in self.default_values().items():
            if getattr(self, name) is None:
                setattr(self, name, copy.copy(value))
        self.check_ranges()
        self.validate_common_fields()
        self.validate_method_fields()
        if self.target_model_config is not None:
            self._validate_target()

    @classmethod
    @functools.cache
    def options(cls) -> dict[str, Option]:
        """Each field's `Option`: its default and range (read once per class)."""
        found = {}
        for name, hint in get_type_hints(cls, include_extras=True).items():
            for meta in getattr(hint, "__metadata__", ()):
                if isinstance(meta, Option):
                    found[name] = meta
        return found

    def check_ranges(self) -> None:
        """Every field with a range (its `Option`) holds a value inside it."""
        for name, option in self.options().items():
            option.check(name, getattr(self, name))

    @classmethod
    def default_values(cls) -> dict[str, Any]:
        """The value each field the user and file left unset takes, where an
        `Option` states one."""
        return {name: option.default for name, option in cls.options().items()
                if option.default is not None}

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        """The method's own keys: its fields beyond the ones every method has."""
        shared = {field.name for field in dataclasses.fields(SelfSpecConfig)}
        return tuple(field.name for field in dataclasses.fields(cls)
                     if field.name not in shared)

    # --- hooks for the method modules -------------------------------------
    def validate_method_fields(self) -> None:
        """Check the method's own fields (those that need no model)."""

    def validate_for_model(self, num_layers: int) -> None:
        """Check the method's fields against the target's layer count."""

    def validate_draft_for_target(self) -> None:
        """Choose and check the weights and vocabulary the draft reads for the
        target (`draft/choice.py`, the base of every method's config)."""
        raise NotImplementedError(f"{type(self).__name__} must derive from DraftChoiceConfig")

    def method_hash_factors(self) -> list[Any]:
        """Fields that change the draft's compiled graph."""
        return [getattr(self, name) for name in self.own_fields()]

    # --- vLLM hooks ---------------------------------------------------------
    def uses_draft_model(self) -> bool:
        return True

    @property
    def max_num_new_slots_for_drafting(self) -> int:
        # Our first draft step reuses the sampled token's own slot; drafting
        # needs lookahead KV slots (num_lookahead_tokens) but no extra inputs.
        return 0

    def compute_hash(self) -> str:
        from vllm.utils.hashing import safe_hash

        factors = [super().compute_hash(), self.method, self.method_hash_factors(),
                   self.draft_precision, self.draft_vocab, self.draft_vocab_size]
        # cost_aware, probe_every and lookup change no graph: not hashed.
        return safe_hash(str(factors).encode(), usedforsecurity=False).hexdigest()

    # --- helpers ------------------------------------------------------------
    def _merge_config_file(self) -> None:
        if self.config_file is None:
            return
        path = resolve_config_file(self.config_file)
        try:
            settings = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SelfSpecConfigError(
                f"speculative_config.config_file: cannot read {path} ({error}); "
                "point it at a JSON file such as vllm_selfspec/configs/smollm2-135m.json."
            ) from error
        layers = settings.get("num_hidden_layers")
        if self.target_model_config is not None and layers not in (
            None, self.target_model_config.hf_config.num_hidden_layers
        ):
            raise SelfSpecConfigError(
                f"speculative_config.config_file: {path} was made for a model with "
                f"{layers} layers, but the target has "
                f"{self.target_model_config.hf_config.num_hidden_layers}; use the "
                "config made for this model."
            )
        methods = settings.get("methods", {})
        if self.method not in methods:
            raise SelfSpecConfigError(
                f"speculative_config.config_file: {path} has no settings for method "
                f"'{self.method}' (it has {sorted(methods)}); add a 'methods."
                f"{self.method}' entry or choose another file."
            )
        allowed = (*self.own_fields(), *COMMON_FIELDS, "num_speculative_tokens")
        fields = type(self).__dataclass_fields__
        for key, value in methods[self.method].items():
            if key not in allowed:
                raise SelfSpecConfigError(
                    f"speculative_config.config_file: {path} sets unknown key '{key}' "
                    f"for method '{self.method}'; remove it."
                )
            if getattr(self, key) is not None:
                continue  # set explicitly by the user
            field_type = eval_field_type(type(self), fields[key].type)
            try:
                value = TypeAdapter(field_type).validate_python(value)
            except ValidationError as error:
                raise SelfSpecConfigError(
                    f"speculative_config.config_file: {path} key '{key}' is invalid "
                    f"({error.errors()[0]['msg']}); fix the file."
                ) from error
            setattr(self, key, value)

    def _validate_target(self) -> None:
        model_config = self.target_model_config
        architectures = list(getattr(model_config.hf_config, "architectures", []) or [])
        if not any(arch in SUPPORTED_ARCHITECTURES for arch in architectures):
            raise SelfSpecConfigError(
                f"speculative_config.method: '{self.method}' cannot run the layers of "
                f"architecture {architectures}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        parallel = self.target_parallel_config
        if parallel is not None and parallel.pipeline_parallel_size > 1:
            raise SelfSpecConfigError(
                "pipeline_parallel_size: self-speculative drafting runs layers from "
                "every pipeline stage on the last one, so it needs "
                "pipeline_parallel_size=1; use tensor parallelism instead."
            )
        if self.disable_padded_drafter_batch:
            raise SelfSpecConfigError(
                "speculative_config.disable_padded_drafter_batch: self-speculative "
                "drafting reads the padded batch's verification results; remove it.")
        if parallel is not None and parallel.data_parallel_size > 1:
            raise SelfSpecConfigError(
                "data_parallel_size: vLLM's runner makes cross-rank dummy drafts on idle "
                "data-parallel ranks that self-speculative drafting does not join; use "
                "data_parallel_size=1 (run one server per replica) with tensor parallelism.")
        layer_types = getattr(model_config.hf_config, "layer_types", None) or []
        if len(set(layer_types)) > 1:
            raise SelfSpecConfigError(
                f"speculative_config.method: '{self.method}' drafts through every layer's "
                f"KV cache as one group, but this model mixes layer types "
                f"{sorted(set(layer_types))} (e.g. sliding-window layers); use a model "
                "whose layers all attend the same way.")
        self.validate_for_model(model_config.hf_config.num_hidden_layers)
        self.validate_draft_for_target()

    # --- fields every method has -------------------------------------------
    def validate_common_fields(self) -> None:
        if self.lookup is True:
            self.lookup = {}
        self._validate_lookup()
        if self.draft_precision not in DRAFT_PRECISIONS:
            raise SelfSpecConfigError(
                f"speculative_config.draft_precision: '{self.draft_precision}' is not "
                f"supported; use one of {list(DRAFT_PRECISIONS)}.")
        if isinstance(self.draft_vocab, int):
            if self.draft_vocab_size not in (None, self.draft_vocab):
                raise SelfSpecConfigError(
                    "speculative_config.draft_vocab_size: draft_vocab already gives the "
                    "size; set one of them.")
            self.draft_vocab_size = self.draft_vocab
        if self.draft_vocab_size is not None and self.draft_vocab == "full":
            raise SelfSpecConfigError(
                "speculative_config.draft_vocab_size: draft_vocab 'full' keeps every "
                "token; remove draft_vocab_size or give draft_vocab a file.")

    def _validate_lookup(self) -> None:
        if self.lookup is False:
            return
        unknown = sorted(set(self.lookup) - set(LOOKUP_DEFAULTS))
        if unknown:
            raise SelfSpecConfigError(
                f"speculative_config.lookup: unknown key(s) {unknown}; it takes "
                f"{sorted(LOOKUP_DEFAULTS)}.")
        self.lookup = {**LOOKUP_DEFAULTS, **self.lookup}
        lookup = self.lookup
        if lookup["source"] not in LOOKUP_SOURCES:
            raise SelfSpecConfigError(
                f"speculative_config.lookup: source {lookup['source']!r} is not one of "
                f"{list(LOOKUP_SOURCES)}.")
        if lookup["source"] == "suffix":
            try:
                importlib.import_module("arctic_inference.suffix_decoding")
            except ImportError:
                raise SelfSpecConfigError(
                    "speculative_config.lookup: source 'suffix' needs Arctic Inference's "
                    "suffix trees; install arctic-inference==0.3.0 (bash scripts/setup.sh "
                    "builds it) or use source 'ngram'.") from None
        for key, option in LOOKUP_OPTIONS.items():
            option.check(f"lookup.{key}", lookup[key])
        if lookup["min_match"] > lookup["max_match"]:
            raise SelfSpecConfigError(
                f"speculative_config.lookup: min_match {lookup['min_match']} and "
                f"max_match {lookup['max_match']} need min_match <= max_match.")


# Keys every method takes (beside num_speculative_tokens, config_file and
# draft_sample_method): the shared fields that declare an Option.
COMMON_FIELDS = tuple(SelfSpecConfig.options())


def eval_field_type(cls: type, field_type: Any) -> Any:
    """Resolve a string annotation (from `from __future__ import annotations`)."""
    if not isinstance(field_type, str):
        return field_type
    module = importlib.import_module(cls.__module__)
    return eval(field_type, vars(module))  # noqa: S307 - our own annotations


def resolve_config_file(name: str) -> Path:
    path = Path(name)
    if path.exists():
        return path
    for candidate in (CONFIGS_DIR / name, CONFIGS_DIR / f"{name}.json"):
        if candidate.exists():
            return candidate
    raise SelfSpecConfigError(
        f"speculative_config.config_file: no file '{name}' (nor under {CONFIGS_DIR}); "
        "give an existing path or the name of a shipped config."
    )


def check_layer_indices(field: str, indices: list[int] | None, num_layers: int) -> None:
    """Layer lists must name existing layers, each once."""
    if indices is None:
        return
    bad = [index for index in indices if not 0 <= index < num_layers]
    if bad:
        raise SelfSpecConfigError(
            f"speculative_config.{field}: layer indices {bad} are out of range; the "
            f"model has layers 0..{num_layers - 1}."
        )
    if len(set(indices)) != len(indices):
        raise SelfSpecConfigError(
            f"speculative_config.{field}: {indices} repeats a layer; list each once."
        )


# vLLM's own SpeculativeConfig keys that a self-speculative method honours
# (the two target configs come from vLLM's engine arguments). Any other vLLM
# key is refused: each configures a separate draft model, another proposer or
# another verification, none of which these methods have, and a key accepted
# but dropped would change nothing without saying so.
HONOURED_VLLM_KEYS = ("method", "num_speculative_tokens", "draft_sample_method",
                      "rejection_sample_method", "target_model_config",
                      "target_parallel_config")
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")


def check_keys(cls: type[SelfSpecConfig], kwargs: dict[str, Any]) -> None:
    """Reject unknown keys, vLLM keys these methods do not implement, and a
    verification other than vLLM's standard rejection sampler, each with a
    sentence naming the key, before pydantic does."""
    method = kwargs.get("method")
    unknown = sorted(set(kwargs) - _field_names(cls))
    if unknown:
        raise SelfSpecConfigError(
            f"speculative_config: unknown key(s) {unknown} for method "
            f"'{method}'; its own keys are {list(cls.own_fields())}, "
            f"plus {list(COMMON_FIELDS)}, num_speculative_tokens, draft_sample_method "
            "and config_file."
        )
    ours = {*cls.own_fields(), *COMMON_FIELDS, "config_file"}
    # ("model" is refused by `__post_init__`, with its own sentence.)
    dropped = sorted(set(kwargs) - ours - set(HONOURED_VLLM_KEYS) - {"model"})
    if dropped:
        raise SelfSpecConfigError(
            f"speculative_config: vLLM key(s) {dropped} do nothing for method '{method}' "
            "(its draft is the target model itself, verified by vLLM's standard "
            "rejection sampler); remove them."
        )
    if kwargs.get("rejection_sample_method", "standard") != "standard":
        raise SelfSpecConfigError(
            f"speculative_config.rejection_sample_method: method '{method}' verifies "
            "with vLLM's standard rejection sampler only, which keeps outputs the "
            "target's; remove the key or set it to 'standard'."
        )
    if kwargs.get("draft_sample_method", "probabilistic") not in DRAFT_SAMPLE_METHODS:
        raise SelfSpecConfigError(
            f"speculative_config.draft_sample_method: use one of {list(DRAFT_SAMPLE_METHODS)}"
            f" (default 'probabilistic'), not {kwargs['draft_sample_method']!r}."
        )
