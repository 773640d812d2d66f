"""What drafts look like between the proposer and the runner hook, and the
draft-side confidence every method reads; imports nothing of the plugin."""

from __future__ import annotations

import torch

# Drafts that stopped early are padded with this id; it is never a real token.
NO_DRAFT = -1

# Where each draft came from, one character per draft token on its way to the
# scheduler (`integration/token_sources.py` counts them): a lookup in the
# request's own text, the method's own mechanism (skipped layers, an early
# exit), or the full-depth base draft.
LOOKUP, MECHANISM, BASE = "l", "m", "b"


def top1_probability(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest softmax probability, as exp(max - logsumexp): no
    full softmax over the vocabulary is materialised."""
    logits = logits.float()
    return torch.exp(logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1))


def top1(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most likely token and its softmax probability, from one
    float copy of the logits (an argmax over bf16 logits is a scalar loop on
    the CPU, several times the float one)."""
    logits = logits.float()
    largest, token_ids = logits.max(dim=-1)
    return token_ids, torch.exp(largest - torch.logsumexp(logits, dim=-1))
