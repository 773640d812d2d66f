"""Drafts of sampled requests drawn from the draft's own distribution.

A one-hot draft (the draft model's argmax) is accepted by vLLM's rejection
sampler with the target's probability of it, p(x): at temperature 0.8 often
well below the greedy acceptance, even where the draft model is nearly the
target. A draft drawn from the draft's own distribution q and handed to the
rejection sampler with q is accepted with probability min(1, p(x) / q(x)), on
average 1 - TV(p, q): near 1 for a self-draft, whose q is nearly p at any
temperature. Either way the output keeps the target distribution exactly, as
long as q is the distribution the draft was truly drawn from.

q is the draft logits at the request's temperature (as vLLM's own
probabilistic drafters do: top-k, top-p and penalties shape p, not q, which
lowers acceptance but not correctness). Greedy requests draft the argmax (their
rows' probabilities are not read). A seeded request draws its drafts from noise
seeded by its seed and the draft's position, so its drafts, like its
output, depend on nothing else in the batch. Rows whose drafts the round did
not sample (lookups) get one-hot rows, which is how vLLM verifies a draft
without probabilities; positions without a draft get zero rows.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.sampler import _SAMPLING_EPS  # below it, vLLM samples greedily


class DraftSampler:
    """One round's draft sampling: tokens per step, then the round's q."""

    def __init__(self, temperature: torch.Tensor, seeds: dict[int, int],
                 batch_size: int, max_drafts: int, vocab_size: int):
        self.random = temperature[:batch_size] >= _SAMPLING_EPS
        self.temperature = torch.where(self.random, temperature[:batch_size], 1.0).view(-1, 1)
        self.seeds = {row: seed for row, seed in seeds.items() if row < batch_size}
        self.probs = torch.zeros(batch_size, max_drafts, vocab_size, dtype=torch.float32,
                                 device=temperature.device)
        self.sampled = torch.zeros(batch_size, max_drafts, dtype=torch.bool,
                                   device=temperature.device)
        self._step_probs: torch.Tensor | None = None

    @classmethod
    def for_round(cls, sampling_metadata, batch_size: int, max_drafts: int,
                  vocab_size: int) -> DraftSampler | None:
        """A sampler for a batch with sampled requests; None when all are greedy."""
        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            return None
        seeds = {row: generator.initial_seed()
                 for row, generator in sampling_metadata.generators.items()}
        return cls(sampling_metadata.temperature, seeds, batch_size, max_drafts, vocab_size)

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This step's draft per row (float `logits`, the drafts' `positions`):
        the argmax for greedy rows, a draw from q for sampled ones."""
        greedy_ids = logits.argmax(dim=-1)
        scaled = logits / self.temperature
        self._step_probs = torch.softmax(scaled, dim=-1)
        return torch.where(self.random, self._draw(scaled, positions), greedy_ids)

    def _seed(self, row: int, positions: torch.Tensor) -> int:
        return hash((self.seeds[row], int(positions[row]))) & (2**63 - 1)

    def _draw(self, scaled: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ~ softmax(scaled) per row: the argmax of the logits plus Gumbel
        noise, through vLLM's CPU kernel of its own sampler (per-row seeds,
        noise per (seed, token); a few times faster than torch's exponential
        draws), else as the argmax of q / E with E ~ Exp(1) per token."""
        if scaled.device.type == "cpu":
            seeds = torch.randint(0, 2**62, (scaled.shape[0],), dtype=torch.long)
            for row in self.seeds:
                seeds[row] = self._seed(row, positions)
            return torch.ops._C.fused_gumbel_argmax(scaled.contiguous(), seeds)
        noise = torch.empty_like(self._step_probs).exponential_()
        for row in self.seeds:
            generator = torch.Generator(device=noise.device)
            generator.manual_seed(self._seed(row, positions))
            noise[row].exponential_(generator=generator)
        return (self._step_probs / noise).argmax(dim=-1)

    def keep(self, step: int, drafting: torch.Tensor) -> None:
        """Keep q of the step's drafts in the rows that took them."""
        kept = drafting & self.random
        self.probs[kept, step] = self._step_probs[kept]
        self.sampled[kept, step] = True

    def round_probs(self, drafts: torch.Tensor) -> torch.Tensor:
        """[batch, max_drafts, vocab] q of every draft: the sampled ones', one-hot
        rows at the other drafts (lookups, greedy rows) and zero rows where there
        is no draft (NO_DRAFT, < 0: vLLM rejects such a pad, and a zero q
        leaves its recovered token the target's own sample)."""
        one_hot = ~self.sampled & (drafts >= 0)
        rows, steps = one_hot.nonzero(as_tuple=True)
        self.probs[rows, steps, drafts[rows, steps]] = 1.0
        return self.probs
