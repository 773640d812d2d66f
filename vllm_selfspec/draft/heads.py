"""Exit heads: early exits through the target's own LM head, after a light transform.

A head at exit layer E (E of the L layers run) predicts the next token as
p_E = softmax(E* . T_E . norm(h_E)), with h_E the residual stream after E layers,
`norm` the target's final norm and E* its frozen LM head (AdaDecode's head, with
the final norm applied first because the target's head was trained on normed
states). T_E is a d x d matrix; T_E = I is the model's own early exit.

Heads live in a directory with `heads.json` (model identity, exit layers,
training record) and `heads.safetensors` (one `exit.<E>.transform` per layer),
written by `scripts/train_exit_heads.py`. `ExitSegment` runs the layers between
two exits as one compiled module and returns the exit's head input.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig

HEADS_FORMAT = "vllm-selfspec-exit-heads/1"
HEADS_JSON = "heads.json"
HEADS_WEIGHTS = "heads.safetensors"


class HeadsFileError(ValueError):
    """Heads that do not fit the target; the message names the field and the fix."""


def transform_key(exit_layer: int) -> str:
    return f"exit.{exit_layer}.transform"


def model_identity(hf_config: Any, norm_weight: torch.Tensor) -> dict[str, Any]:
    """What heads must match: the shapes, and the final norm's weights (which
    tell a base model from its fine-tune and a random model from a trained one)."""
    as_bf16 = norm_weight.detach().to("cpu", torch.bfloat16).contiguous()
    return {
        "architectures": list(getattr(hf_config, "architectures", None) or []),
        "num_hidden_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "vocab_size": hf_config.vocab_size,
        "final_norm_sha256": hashlib.sha256(
            as_bf16.view(torch.int16).numpy().tobytes()).hexdigest(),
    }


@functools.lru_cache(maxsize=8)
def local_final_norm(model: str) -> torch.Tensor | None:
    """The final norm's weight, read from a local checkpoint (None if remote).
    Kept per path: start-up matches the vocabulary, the heads and their
    checks against it, each asking once (callers copy, never modify it)."""
    from safetensors import safe_open

    for file in sorted(Path(model).glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            if "model.norm.weight" in weights.keys():
                return weights.get_tensor("model.norm.weight")
    return None


@dataclass(frozen=True)
class ExitHeads:
    """A heads directory, read and checked against a model."""

    path: Path
    meta: dict[str, Any]

    @property
    def exit_layers(self) -> list[int]:
        return list(self.meta["exit_layers"])

    @classmethod
    def open(cls, location: str, field: str = "heads") -> ExitHeads:
        path = Path(location)
        if path.name == HEADS_JSON:
            path = path.parent
        meta_file = path / HEADS_JSON
        if not meta_file.is_file() or not (path / HEADS_WEIGHTS).is_file():
            raise HeadsFileError(
                f"speculative_config.{field}: {path} has no {HEADS_JSON} and "
                f"{HEADS_WEIGHTS}; train heads with scripts/train_exit_heads.py and "
                "point at their directory."
            )
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != HEADS_FORMAT:
            raise HeadsFileError(
                f"speculative_config.{field}: {meta_file} is not a heads file of "
                f"format {HEADS_FORMAT}; retrain with scripts/train_exit_heads.py."
            )
        return cls(path, meta)

    def check_shapes(self, hf_config: Any, field: str = "heads") -> None:
        """Everything checkable from the model's config, before any weights load."""
        trained_for = self.meta["model"]
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if trained_for[key] != getattr(hf_config, key):
                raise HeadsFileError(
                    f"speculative_config.{field}: {self.path} was trained for a model "
                    f"with {key}={trained_for[key]}, the target has "
                    f"{getattr(hf_config, key)}; train heads for this model."
                )
        self.check_layers(hf_config.num_hidden_layers, field)
        from safetensors import safe_open

        hidden = hf_config.hidden_size
        with safe_open(self.path / HEADS_WEIGHTS, framework="pt") as weights:
            names = set(weights.keys())
            for layer in self.exit_layers:
                key = transform_key(layer)
                shape = list(weights.get_slice(key).get_shape()) if key in names else None
                if shape != [hidden, hidden]:
                    raise HeadsFileError(
                        f"speculative_config.{field}: {self.path / HEADS_WEIGHTS} "
                        f"holds {key} with shape {shape}, expected [{hidden}, {hidden}]; "
                        "the file is damaged or for another model, retrain it."
                    )

    def check_layers(self, num_layers: int, field: str = "heads") -> None:
        bad = [e for e in self.exit_layers if not 1 <= e <= num_layers]
        if bad:
            raise HeadsFileError(
                f"speculative_config.{field}: {self.path} has exit layers {bad} outside "
                f"1..{num_layers}; the file is for another model, retrain it."
            )

    def check_identity(self, identity: dict[str, Any], field: str = "heads") -> None:
        trained_for = self.meta["model"]
        if trained_for["final_norm_sha256"] != identity["final_norm_sha256"]:
            raise HeadsFileError(
                f"speculative_config.{field}: {self.path} was trained for "
                f"{trained_for.get('name', 'another model')}, whose weights differ "
                "from the target's (final-norm hash mismatch); train heads for this "
                "model with scripts/train_exit_heads.py."
            )

    def transforms(self, layers: list[int]) -> dict[int, torch.Tensor]:
        from safetensors.torch import load_file

        weights = load_file(self.path / HEADS_WEIGHTS)
        return {layer: weights[transform_key(layer)] for layer in layers}


def save_heads(
    out: Path, name: str, identity: dict[str, Any], transforms: dict[int, torch.Tensor],
    **record: Any,
) -> None:
    """Write a heads directory; `record` (training data, agreement) goes into the JSON."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({transform_key(e): t.detach().float().clone().contiguous()
               for e, t in transforms.items()}, out / HEADS_WEIGHTS)
    meta = {"format": HEADS_FORMAT, "model": {"name": name, **identity},
            "exit_layers": sorted(transforms),
            "head": "logits = lm_head(T_E @ final_norm(h_E)), T_E d x d", **record}
    (out / HEADS_JSON).write_text(json.dumps(meta, indent=2))


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "residual": 0}
)
class ExitSegment(nn.Module):
    """Layers [start, end) of the draft's layers (the target's, or their
    low-precision copies), then the head input of exit `end`.

    The first segment starts from token ids; later ones continue the residual
    pair (hidden_states, residual) the previous segment returned.
    """

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        prefix: str = "",
        target: nn.Module,
        adapter: ModuleType,
        layers: nn.ModuleList,
        start: int,
        end: int,
        transform: torch.Tensor | None,
    ) -> None:
        super().__init__()
        decoder = adapter.decoder(target)
        self.embed_tokens = decoder.embed_tokens if start == 0 else None
        self.layers = nn.ModuleList(layers[start:end])
        self.norm = decoder.norm
        self.start, self.end = start, end
        if transform is None:
            self.transform = None
        else:
            dtype = decoder.norm.weight.dtype
            self.register_buffer("transform", transform.to(decoder.norm.weight.device,
                                                            dtype))

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.embed_tokens is not None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        # A fresh sum: the fused add-norm would overwrite the pair in place.
        return hidden_states, residual, self.head_input(hidden_states + residual)

    def head_input(self, stream: torch.Tensor) -> torch.Tensor:
        """The exit head's input for residual-stream states after `end` layers."""
        head_input = self.norm(stream)
        if self.transform is not None:
            head_input = head_input @ self.transform.t()
        return head_input


class ExitDraft(nn.Module):
    """The segments up to the deepest exit, chained; `forward` runs them all
    (vLLM's warm-up and profiling call it), `segments` one at a time."""

    def __init__(self, segments: list[ExitSegment], compute_logits, num_layers: int):
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self._compute_logits = compute_logits
        from vllm_selfspec.draft.plan import LayerPlan

        deepest = segments[-1].end
        self.plan = LayerPlan.skipping(num_layers, list(range(deepest, num_layers)),
                                       list(range(deepest, num_layers)))

    @property
    def exit_layers(self) -> list[int]:
        return [segment.end for segment in self.segments]

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        hidden_states = residual = head_input = None
        for segment in self.segments:
            hidden_states, residual, head_input = segment(
                input_ids, positions, hidden_states, residual)
        return head_input

    def compute_logits(self, head_input: torch.Tensor) -> torch.Tensor | None:
        return self._compute_logits(head_input)
