"""What drafts look like between the proposer and the runner hook, and the
draft-side confidence every method reads; imports nothing of the plugin."""

from __future__ import annotations

import torch

# Drafts that stopped early are padded with this id; it is never a real token.
NO_DRAFT = -1


def top1_probability(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest softmax probability, as exp(max - logsumexp): no
    full softmax over the vocabulary is materialised."""
    logits = logits.float()
    return torch.exp(logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1))
