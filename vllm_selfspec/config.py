"""Speculative configs of the self-speculative methods.

vLLM's `SpeculativeConfig` forbids unknown methods and keys, so each method has
a subclass of it (declared in its own module under `proposers/`) and the
plugin routes `SpeculativeConfig(method=<ours>, ...)` to that subclass. The
subclass reports `uses_draft_model()`, which makes vLLM reserve lookahead KV
slots, run the drafter on the sampled-token tensor, and build our proposer
where it would build a draft-model proposer (see `patches.py`).

This module imports only vLLM's config package, so a pickled config can be
rebuilt in engine and worker processes before the plugin is loaded there.
"""

from __future__ import annotations

import importlib
import importlib.resources
import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import TypeAdapter, ValidationError
from vllm.config import SpeculativeConfig
from vllm.config.utils import config

# method name -> module that defines its config class and proposer class.
METHOD_MODULES = {
    "draft_verify": "vllm_selfspec.proposers.draft_verify",
    "adadecode": "vllm_selfspec.proposers.adadecode",
    "del": "vllm_selfspec.proposers.dynamic_exit",
    "swift": "vllm_selfspec.proposers.swift",
}

# The shipped vocabularies, exit heads and skip sets: package data, so a
# wheel install finds them as an editable one does.
CONFIGS_DIR = Path(str(importlib.resources.files("vllm_selfspec") / "configs"))

# Architectures whose decoder layers the draft engine knows how to run.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


# Keys every method takes (beside num_speculative_tokens and config_file).
COMMON_FIELDS = ("draft_precision", "draft_vocab", "draft_vocab_size", "cost_aware",
                 "probe_every", "lookup")
DRAFT_PRECISIONS = ("auto", "bf16", "int8", "int4")


class SelfSpecConfigError(ValueError):
    """A self-speculative config that cannot work; the message names the field."""


def method_module(method: str):
    return importlib.import_module(METHOD_MODULES[method])


def config_class_for(method: str) -> type[SelfSpecConfig]:
    return method_module(method).CONFIG_CLASS


def _field_names(cls: type) -> set[str]:
    return set(cls.__dataclass_fields__)


@config
class SelfSpecConfig(SpeculativeConfig):
    """Fields and checks shared by every self-speculative method."""

    config_file: str | None = None
    """JSON file (path, or a name under `vllm_selfspec/configs/`) with this method's settings
    for a model, e.g. a searched skip set. Keys set explicitly win."""
    draft_precision: str | None = None
    """Weights the draft reads: "auto" (default, the target's own), "bf16" (the
    target's, which must be bf16), "int8" (a W8A8 copy made at start-up, vLLM's
    int8 kernels) or "int4" (a W4A16 copy; bf16/fp16 models). Verification
    always uses the target's own weights."""
    draft_vocab: str | int | None = None
    """Draft LM head over a frequent-token subset: a vocabulary file (path or a
    name under vllm_selfspec/configs/vocab/), or a size N (the top N of the file shipped for
    this model). Drafts never leave the subset; verification uses the full head."""
    draft_vocab_size: int | None = None
    """Tokens of the draft_vocab file to keep (default: the file's own size)."""
    cost_aware: bool | None = None
    """Draft only as many tokens per request and round as pay for themselves,
    given the draft step's measured cost and the request's own acceptance
    (zero included: then the step is plain decoding). Default true."""
    probe_every: int | None = None
    """Requests that stopped drafting draft one token on every this-many-th
    engine round (together), to notice when their text turns predictable
    (default 16)."""
    draft_sample_method: str = "probabilistic"
    """How a sampled request's self-drafts are drawn (vLLM's key, with
    another default): "probabilistic" draws them from the draft's own
    distribution at the request's temperature and verifies them with it, so
    they keep nearly their greedy acceptance at any temperature; "greedy"
    drafts the argmax, accepted with the target's probability of it. Both
    keep the target distribution exactly; lookup drafts are one token each."""
    lookup: dict[str, int] | None = None
    """Try a free draft from the request's own text first: {"min_match": 2,
    "max_match": 8, "max_tokens": 12} (or {} for these defaults). When the
    request's last min_match..max_match tokens occurred earlier in it, the
    tokens that followed are this round's drafts and no self-draft runs for
    it: with cost_aware as many (up to max_tokens) as its own lookups' record
    makes worth verifying, else max_tokens."""

    # Defaults a method module sets; None means "not given by the user".
    default_num_speculative_tokens: ClassVar[int] = 4
    own_fields: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[dict[str, Any]] = {}  # for fields the user and file left unset

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
        for name, value in self.defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, list(value) if isinstance(value, list) else value)
        self.validate_common_fields()
        self.validate_method_fields()
        if self.target_model_config is not None:
            self._validate_target()

    # --- hooks for the method modules -------------------------------------
    def validate_method_fields(self) -> None:
        """Check the method's own fields (those that need no model)."""

    def validate_for_model(self, num_layers: int) -> None:
        """Check the method's fields against the target's layer count."""

    def method_hash_factors(self) -> list[Any]:
        """Fields that change the draft's compiled graph."""
        return [getattr(self, name) for name in self.own_fields]

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
        allowed = (*self.own_fields, *COMMON_FIELDS, "num_speculative_tokens")
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
        self._validate_draft_weights_for_model()

    # --- draft weights and vocabulary ---------------------------------------
    def validate_common_fields(self) -> None:
        if self.draft_precision is None:
            self.draft_precision = "auto"
        if self.cost_aware is None:
            self.cost_aware = True
        if self.probe_every is None:
            self.probe_every = 16
        if self.probe_every < 1:
            raise SelfSpecConfigError(
                f"speculative_config.probe_every: {self.probe_every} must be >= 1.")
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
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise SelfSpecConfigError(
                f"speculative_config.draft_vocab_size: {self.draft_vocab_size} must be "
                ">= 1.")
        if self.draft_vocab_size is not None and self.draft_vocab is None:
            raise SelfSpecConfigError(
                "speculative_config.draft_vocab_size: needs draft_vocab (a file, or "
                "give the size as draft_vocab).")

    def _validate_lookup(self) -> None:
        if self.lookup is None:
            return
        from vllm_selfspec.workers.lookup import LOOKUP_DEFAULTS

        unknown = sorted(set(self.lookup) - set(LOOKUP_DEFAULTS))
        if unknown:
            raise SelfSpecConfigError(
                f"speculative_config.lookup: unknown key(s) {unknown}; it takes "
                f"{sorted(LOOKUP_DEFAULTS)}.")
        self.lookup = {**LOOKUP_DEFAULTS, **self.lookup}
        if not 1 <= self.lookup["min_match"] <= self.lookup["max_match"]:
            raise SelfSpecConfigError(
                f"speculative_config.lookup: min_match {self.lookup['min_match']} and "
                f"max_match {self.lookup['max_match']} need 1 <= min_match <= max_match.")
        if self.lookup["max_tokens"] < 1:
            raise SelfSpecConfigError(
                f"speculative_config.lookup: max_tokens {self.lookup['max_tokens']} must be "
                ">= 1 (the most tokens one lookup drafts).")

    def _validate_draft_weights_for_model(self) -> None:
        from vllm_selfspec.workers.draft_weights import int4_shape_problem

        model_config = self.target_model_config
        dtype = model_config.dtype
        if self.draft_precision == "bf16" and str(dtype) != "torch.bfloat16":
            raise SelfSpecConfigError(
                f"speculative_config.draft_precision: 'bf16' drafts with the target's "
                f"own bf16 weights, but the target runs in {dtype}; use 'int8', or "
                "leave it unset.")
        if self.draft_precision in ("int8", "int4"):
            from vllm.platforms import current_platform

            if not (current_platform.is_cpu() or current_platform.is_cuda_alike()):
                raise SelfSpecConfigError(
                    f"speculative_config.draft_precision: '{self.draft_precision}' needs "
                    "vLLM's CPU or CUDA/ROCm kernels; this platform has neither, leave "
                    "it unset.")
            if current_platform.is_cuda_alike() and str(dtype) not in (
                    "torch.bfloat16", "torch.float16"):
                raise SelfSpecConfigError(
                    f"speculative_config.draft_precision: '{self.draft_precision}' on a GPU "
                    f"needs bf16 or fp16 activations (vLLM's int8/int4 GPU kernels), the "
                    f"target runs in {dtype}; load the model with dtype bfloat16.")
        if self.draft_precision == "int4":
            if str(dtype) not in ("torch.bfloat16", "torch.float16"):
                raise SelfSpecConfigError(
                    f"speculative_config.draft_precision: 'int4' (W4A16) needs bf16 or "
                    f"fp16 activations, the target runs in {dtype}; use 'int8', or "
                    "load the model with dtype bfloat16.")
            for shape in _linear_shard_shapes(model_config.hf_config,
                                              self.target_parallel_config):
                problem = int4_shape_problem(*shape)
                if problem:
                    raise SelfSpecConfigError(
                        f"speculative_config.draft_precision: 'int4' cannot run this "
                        f"model's layers ({problem}); use 'int8'.")
        if self.draft_vocab is not None:
            self._check_draft_vocab()

    def _check_draft_vocab(self) -> None:
        from vllm_selfspec.draft_vocab import DraftVocab, DraftVocabError, shipped_for
        from vllm_selfspec.workers.exit_heads import local_final_norm, model_identity

        hf_config = self.target_model_config.hf_config
        norm_weight = local_final_norm(self.target_model_config.model)
        try:
            if norm_weight is None:  # a remote model: the worker checks at load
                if isinstance(self.draft_vocab, int):
                    raise DraftVocabError(
                        "speculative_config.draft_vocab: a size needs the model's "
                        "files on disk to find its shipped vocabulary; give a file.")
                vocab = DraftVocab.open(self.draft_vocab)
            else:
                identity = model_identity(hf_config, norm_weight)
                vocab = (shipped_for(identity) if isinstance(self.draft_vocab, int)
                         else DraftVocab.open(self.draft_vocab))
                vocab.check(identity)
            vocab.token_ids(self.draft_vocab_size)
        except DraftVocabError as error:
            raise SelfSpecConfigError(str(error)) from None
        self.draft_vocab = str(vocab.path)
        self.draft_vocab_size = self.draft_vocab_size or vocab.size

    def draft_vocab_token_ids(self, final_norm=None) -> list[int] | None:
        """The draft head's tokens (None: the whole vocabulary); with the
        loaded model's final norm, the file is checked against it too (the
        start-up check can only read local checkpoints)."""
        if self.draft_vocab is None:
            return None
        from vllm_selfspec.draft_vocab import DraftVocab, DraftVocabError
        from vllm_selfspec.workers.exit_heads import model_identity

        vocab = DraftVocab.open(str(self.draft_vocab))
        if final_norm is not None:
            try:
                vocab.check(model_identity(self.target_model_config.hf_config, final_norm))
            except DraftVocabError as error:
                raise SelfSpecConfigError(str(error)) from None
        return vocab.token_ids(self.draft_vocab_size)


def _linear_shard_shapes(hf_config: Any, parallel_config: Any) -> list[tuple[int, int]]:
    """(out, in) of each decoder linear weight on one tensor-parallel rank."""
    tp = parallel_config.tensor_parallel_size if parallel_config is not None else 1
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    kv_per_rank = max(kv_heads // tp, 1)
    return [
        ((heads // tp + 2 * kv_per_rank) * head_dim, hidden),  # qkv_proj
        (hidden, heads // tp * head_dim),                      # o_proj
        (2 * inter // tp, hidden),                             # gate_up_proj
        (hidden, inter // tp),                                 # down_proj
    ]


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
            f"'{method}'; its own keys are {list(cls.own_fields)}, "
            f"plus {list(COMMON_FIELDS)}, num_speculative_tokens, draft_sample_method "
            "and config_file."
        )
    ours = {*cls.own_fields, *COMMON_FIELDS, "config_file"}
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
