"""The draft's weights and vocabulary, chosen and checked for the target:
what "auto" precision means on this platform, which vocabulary file is
shipped for these weights, whether an int4 copy can run these shapes. Every
method's config class derives from `DraftChoiceConfig`, so these checks run at
start-up, before the engine loads anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.config.utils import config
from vllm.logger import init_logger

from vllm_selfspec.config import GPU_COPY_SHARE, SelfSpecConfig, SelfSpecConfigError
from vllm_selfspec.draft.heads import local_final_norm, model_identity
from vllm_selfspec.draft.kernels import int4_shape_problem, int8_runs_fbgemm
from vllm_selfspec.draft.vocab import DraftVocab, DraftVocabError, shipped_for

logger = init_logger(f"vllm.{__name__}")


@config
class DraftChoiceConfig(SelfSpecConfig):
    """A self-speculative config whose draft weights and vocabulary are chosen
    and checked for the target."""

    def validate_draft_for_target(self) -> None:
        model_config = self.target_model_config
        dtype = model_config.dtype
        chosen = []
        if self.draft_precision == "auto":
            self.draft_precision, why = self._automatic_precision()
            chosen.append(f"draft_precision '{self.draft_precision}' ({why})")
        if self.draft_vocab is None:
            self.draft_vocab, why = self._automatic_vocab()
            chosen.append(f"draft_vocab '{Path(self.draft_vocab).stem}' ({why})")
            if self.draft_vocab == "full" and self.draft_vocab_size is not None:
                raise SelfSpecConfigError(
                    f"speculative_config.draft_vocab_size: {why}, so there is no file "
                    "to keep tokens of; give draft_vocab a vocabulary file.")
        if chosen:
            logger.info("vllm-selfspec %s chose %s; set these keys to choose otherwise.",
                        self.method, ", ".join(chosen))
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
            for shape in linear_shard_shapes(model_config.hf_config,
                                              self.target_parallel_config):
                problem = int4_shape_problem(*shape)
                if problem:
                    raise SelfSpecConfigError(
                        f"speculative_config.draft_precision: 'int4' cannot run this "
                        f"model's layers ({problem}); use 'int8'.")
        if self.draft_vocab != "full":
            self._check_draft_vocab()

    def _automatic_precision(self) -> tuple[str, str]:
        """What "auto" means on this platform for this model, and why."""
        from vllm.platforms import current_platform

        model_config = self.target_model_config
        dtype = str(model_config.dtype)
        if model_config.quantization is not None:
            return "target", f"the target is already {model_config.quantization}-quantised"
        if current_platform.is_cpu():
            kernel = ("PyTorch's fbgemm kernel: this CPU has no VNNI or AMX"
                      if int8_runs_fbgemm() else "vLLM's int8 kernel")
            return "int8", (f"an int8 copy reads 1/{model_config.dtype.itemsize} of the "
                            f"target's {dtype.removeprefix('torch.')} bytes; {kernel}")
        if current_platform.is_cuda_alike():
            if dtype not in ("torch.bfloat16", "torch.float16"):
                return "target", f"vLLM's int8 GPU kernels need bf16/fp16, the target runs {dtype}"
            shapes = linear_shard_shapes(model_config.hf_config, self.target_parallel_config)
            copy = model_config.hf_config.num_hidden_layers * sum(o * i for o, i in shapes)
            memory = current_platform.get_device_total_memory()
            share = copy / memory
            if share > GPU_COPY_SHARE:
                return "target", (f"an int8 copy would take {copy / 1e9:.1f} GB, "
                                  f"{share:.0%} of this GPU's memory, from the KV cache")
            return "int8", f"an int8 copy takes {copy / 1e9:.1f} GB, {share:.0%} of this GPU"
        return "target", f"no int8 kernels for {current_platform.device_name}"

    def _automatic_vocab(self) -> tuple[str, str]:
        """The vocabulary shipped for this model, else "full", and why."""
        identity = local_identity(self.target_model_config)
        if identity is None:
            return "full", "a remote model: its weights cannot be matched before loading"
        try:
            return str(shipped_for(identity).path), "shipped for this model"
        except DraftVocabError:
            return "full", "none is shipped for this model"

    def _check_draft_vocab(self) -> None:
        identity = local_identity(self.target_model_config)
        try:
            if identity is None:  # a remote model: the worker checks at load
                if isinstance(self.draft_vocab, int):
                    raise DraftVocabError(
                        "speculative_config.draft_vocab: a size needs the model's "
                        "files on disk to find its shipped vocabulary; give a file.")
                vocab = DraftVocab.open(self.draft_vocab)
            else:
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
        if self.draft_vocab in (None, "full"):
            return None
        vocab = DraftVocab.open(str(self.draft_vocab))
        if final_norm is not None:
            try:
                vocab.check(model_identity(self.target_model_config.hf_config, final_norm))
            except DraftVocabError as error:
                raise SelfSpecConfigError(str(error)) from None
        return vocab.token_ids(self.draft_vocab_size)


def local_identity(model_config: Any) -> dict[str, Any] | None:
    """The identity shipped assets are matched by (exit_heads.model_identity),
    read from a local checkpoint; None for a remote one."""
    norm_weight = local_final_norm(model_config.model)
    return None if norm_weight is None else model_identity(model_config.hf_config,
                                                            norm_weight)


def linear_shard_shapes(hf_config: Any, parallel_config: Any) -> list[tuple[int, int]]:
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
