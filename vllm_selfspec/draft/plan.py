"""Which sub-blocks of the target's layers a draft runs: a plain value the
policy (SWIFT's search) and the draft model share, so it needs neither torch
nor vLLM."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerPlan:
    """Which attention and MLP sub-blocks of each layer the draft runs."""

    attention: tuple[bool, ...]
    mlp: tuple[bool, ...]

    @classmethod
    def skipping(
        cls, num_layers: int, attn_skip: list[int] | None, mlp_skip: list[int] | None
    ) -> LayerPlan:
        attn, mlp = set(attn_skip or ()), set(mlp_skip or ())
        return cls(
            attention=tuple(i not in attn for i in range(num_layers)),
            mlp=tuple(i not in mlp for i in range(num_layers)),
        )

    @property
    def num_layers(self) -> int:
        return len(self.attention)

    @property
    def fraction_run(self) -> float:
        """Share of sub-blocks run, counting attention and MLP alike."""
        return (sum(self.attention) + sum(self.mlp)) / (2 * self.num_layers)

    def digest(self) -> str:
        """Short stable name of the plan (for compile-cache tags)."""
        return hashlib.sha256(repr((self.attention, self.mlp)).encode()).hexdigest()[:12]

    def describe(self) -> str:
        skipped_attn = [i for i, runs in enumerate(self.attention) if not runs]
        skipped_mlp = [i for i, runs in enumerate(self.mlp) if not runs]
        return f"attn_skip={skipped_attn} mlp_skip={skipped_mlp}"
