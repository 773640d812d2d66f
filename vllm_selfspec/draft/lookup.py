"""Free drafts from the request's own text, tried before any self-draft.

The longest suffix of a request's tokens (prompt and output so far) that
occurred earlier in them, if it is at least `min_match` tokens long, proposes
the tokens that followed that earlier occurrence: vLLM's own n-gram matcher
(`NgramProposer`'s KMP search, `_find_longest_matched_ngram_and_propose_tokens`)
on the request's tokens. A request with such a match drafts those tokens this
round and runs no self-draft; the others self-draft as usual.

The drafter runs before vLLM's bookkeeping of the step that just ran, so a
request's tokens are vLLM's record up to the previous step plus what that step
accepted: the verified drafts vLLM kept and the token it sampled.
"""

from __future__ import annotations

import numpy as np

# A lookup draft is at most `max_tokens` long (and at most the method's
# num_speculative_tokens): its tokens cost no draft step but each is verified.
# Cost-aware drafting sizes each request's lookups by their record below that
# cap (`RoundPolicy.lookup_lengths`): long in text that copies long spans,
# short where a match's continuation soon parts from the target's
# (docs/results/batch1.md). Without it every lookup may run to the cap.
LOOKUP_DEFAULTS = {"min_match": 2, "max_match": 8, "max_tokens": 12}
LOOKUP_KEYS = {
    "min_match": "The fewest of a request's last tokens that must have occurred before.",
    "max_match": "The most of its last tokens matched (the longest match wins).",
    "max_tokens": "The most tokens one lookup drafts.",
}


def request_tokens(recorded: np.ndarray, step_tokens: list[int], first_row: int,
                   accepted: int, next_token: int) -> np.ndarray:
    """`recorded` (vLLM's tokens of the request before this step), then the
    drafts this step accepted (they follow the step's first input row), then
    the token it sampled."""
    kept = step_tokens[first_row + 1:first_row + 1 + accepted]
    return np.concatenate([recorded, np.asarray([*kept, next_token], dtype=recorded.dtype)])


def lookup_drafts(req_ids: list[str], lengths: list[int], discarded: np.ndarray,
                  token_ids: np.ndarray, num_recorded: np.ndarray, step_tokens: list[int],
                  first_rows: list[int], next_tokens: list[int], accepted: dict[str, int],
                  settings: dict[str, int], max_model_len: int) -> dict[int, np.ndarray]:
    """Each row's lookup draft where the request's own text offers a match,
    in row order: at most `lengths[row]` tokens (none where that is 0 or
    vLLM discards the row's sample). A request's tokens are vLLM's record
    (`token_ids[row, :num_recorded[row]]`), then what the step that just ran
    accepted and sampled (`request_tokens`, from the step's flat input
    `step_tokens`, each request's `first_rows` and `next_tokens`); `settings`
    is the method's `lookup` option."""
    found: dict[int, np.ndarray] = {}
    for row, req_id in enumerate(req_ids):
        if discarded[row] or not lengths[row]:
            continue
        context = request_tokens(token_ids[row, :num_recorded[row]], step_tokens,
                                 first_rows[row], accepted.get(req_id, 0), next_tokens[row])
        draft = lookup_draft(context, settings["min_match"], settings["max_match"],
                             max_model_len, lengths[row])
        if len(draft):
            found[row] = draft
    return found


def lookup_draft(tokens: np.ndarray, min_match: int, max_match: int, max_model_len: int,
                 num_tokens: int) -> np.ndarray:
    """The continuation of the longest earlier match of the tokens' suffix
    (empty when it is shorter than `min_match`)."""
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens,
    )

    return _find_longest_matched_ngram_and_propose_tokens(
        tokens, min_match, max_match, max_model_len, num_tokens)


def compile_lookup(max_model_len: int) -> None:
    """Compile vLLM's matcher (numba) for vLLM's token dtype now, at start-up,
    as vLLM's `NgramProposer` does: compiled at a request's first lookup it
    added about a second to that request."""
    tokens = np.arange(8, dtype=np.int32) % 2
    lookup_draft(tokens, LOOKUP_DEFAULTS["min_match"], LOOKUP_DEFAULTS["max_match"],
                 max_model_len, LOOKUP_DEFAULTS["max_tokens"])
