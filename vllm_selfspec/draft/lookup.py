"""Free drafts from text already seen, tried before any self-draft.

Two sources (`lookup.source`). "ngram": the longest suffix of a request's
tokens (prompt and output so far) that occurred earlier in them, if it is at
least `min_match` tokens long, proposes the tokens that followed that earlier
occurrence: vLLM's own n-gram matcher (`NgramProposer`'s KMP search,
`_find_longest_matched_ngram_and_propose_tokens`) on the request's tokens.
"suffix": Arctic Inference's suffix trees (`SuffixDecodingCache`, the library
behind vLLM's `suffix` method): one per live request over its prompt and
output, and one over the engine's past responses (at most
`max_cached_requests`, the oldest evicted first); the draft is the likelier
of the two trees' continuations, as long as its frequency estimate allows. A
request with a draft from either runs no self-draft this round; the others
self-draft as usual.

The drafter runs before vLLM's bookkeeping of the step that just ran, so a
request's tokens are vLLM's record up to the previous step plus what that step
accepted: the verified drafts vLLM kept and the token it sampled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from vllm.logger import init_logger

from vllm_selfspec.config import LOOKUP_DEFAULTS

logger = init_logger(__name__)

# Every this many requests started, the suffix cache logs its size.
LOG_CACHE_EVERY = 256

def request_tokens(recorded: np.ndarray, step_tokens: list[int], first_row: int,
                   accepted: int, next_token: int) -> np.ndarray:
    """`recorded` (vLLM's tokens of the request before this step), then the
    drafts this step accepted (they follow the step's first input row), then
    the token it sampled."""
    kept = step_tokens[first_row + 1:first_row + 1 + accepted]
    return np.concatenate([recorded, np.asarray([*kept, next_token], dtype=recorded.dtype)])


def request_contexts(req_ids: list[str], discarded: np.ndarray, token_ids: np.ndarray,
                     num_recorded: np.ndarray, step_tokens: list[int], first_rows: list[int],
                     next_tokens: list[int], accepted: dict[str, int]
                     ) -> Iterator[tuple[int, str, np.ndarray]]:
    """(row, request, its tokens) for each row whose sample vLLM keeps: vLLM's
    record (`token_ids[row, :num_recorded[row]]`), then what the step that
    just ran accepted and sampled (`request_tokens`, from the step's flat
    input `step_tokens`, each request's `first_rows` and `next_tokens`)."""
    for row, req_id in enumerate(req_ids):
        if not discarded[row]:
            yield row, req_id, request_tokens(
                token_ids[row, :num_recorded[row]], step_tokens, first_rows[row],
                accepted.get(req_id, 0), next_tokens[row])


@dataclass(frozen=True)
class LookupDraft:
    """A looked-up draft, and where its source estimates it (suffix trees),
    each prefix's chance of being accepted whole (else None) and the length of
    the match that found it (else 0)."""

    tokens: np.ndarray
    path_probabilities: list[float] | None = None
    match_length: int = 0


class Lookup(Protocol):
    """A lookup source, as the drafter uses it."""

    # Whether the source estimates each draft's chance itself, so that each
    # draft is sized by that estimate (`RoundPolicy.source_draft_length`)
    # rather than by the request's record of its lookups.
    sizes_drafts: bool

    def drafts(self, contexts: Iterator[tuple[int, str, np.ndarray]], lengths: list[int],
               num_prompt_tokens: np.ndarray) -> dict[int, LookupDraft]:
        """Each row's draft where the source offers one, at most
        `lengths[row]` tokens (none where that is 0), in row order."""

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the state of requests vLLM no longer holds."""

    def per_request_state(self) -> dict[str, int]:
        """Requests with state held now, per kind of state."""


def make_lookup(settings: dict | None, max_model_len: int) -> Lookup | None:
    """The method's `lookup` option's source, ready to draft (None: off)."""
    if not settings:
        return None
    if settings["source"] == "suffix":
        return SuffixLookup(settings, max_model_len)
    return NgramLookup(settings, max_model_len)


class NgramLookup:
    """vLLM's n-gram matcher over each request's own tokens; no state."""

    sizes_drafts = False

    def __init__(self, settings: dict, max_model_len: int):
        self.settings = settings
        self.max_model_len = max_model_len
        compile_lookup(max_model_len)

    def drafts(self, contexts: Iterator[tuple[int, str, np.ndarray]], lengths: list[int],
               num_prompt_tokens: np.ndarray) -> dict[int, LookupDraft]:
        found: dict[int, LookupDraft] = {}
        for row, _, context in contexts:
            if not lengths[row]:
                continue
            draft = lookup_draft(context, self.settings["min_match"],
                                 self.settings["max_match"], self.max_model_len, lengths[row])
            if len(draft):
                found[row] = LookupDraft(draft)
        return found

    def forget(self, live_req_ids: set[str]) -> None:
        pass

    def per_request_state(self) -> dict[str, int]:
        return {}


class SuffixLookup:
    """Drafts from Arctic Inference's `SuffixDecodingCache`: a tree per live
    request over its prompt and output, fed every token the request gains, and
    the cache's tree of past responses (a request's response joins it when
    the request starts and stays until `max_cached_requests` newer ones
    evict it). Built from tokens alone, so alike on every tensor-parallel
    rank. Its frequency estimate sizes each draft (`sizes_drafts`)."""

    sizes_drafts = True

    def __init__(self, settings: dict, max_model_len: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.settings = settings
        self.max_model_len = max_model_len
        self.cache = SuffixDecodingCache(max_tree_depth=settings["max_tree_depth"],
                                         max_cached_requests=settings["max_cached_requests"])
        self.fed: dict[str, int] = {}  # per live request, its tokens the cache holds
        self.started = 0

    def drafts(self, contexts: Iterator[tuple[int, str, np.ndarray]], lengths: list[int],
               num_prompt_tokens: np.ndarray) -> dict[int, LookupDraft]:
        """Each row's draft where the trees offer one, at most `lengths[row]`
        tokens, with the trees' estimate of each prefix's chance (the share of
        the match's past continuations that went on so far) and the match's
        length; every row's new
        tokens are fed to the cache first."""
        found: dict[int, LookupDraft] = {}
        depth = self.settings["max_tree_depth"]
        for row, req_id, context in contexts:
            self._feed(req_id, context, int(num_prompt_tokens[row]))
            room = min(lengths[row], self.max_model_len - len(context) - 1)
            if room < 1:
                continue
            draft = self.cache.speculate(
                req_id, np.ascontiguousarray(context[-depth:], dtype=np.int32),
                max_spec_tokens=room, max_spec_factor=self.settings["max_spec_factor"],
                min_token_prob=self.settings["min_token_prob"])
            if draft.token_ids:
                found[row] = LookupDraft(np.asarray(draft.token_ids, dtype=np.int64),
                                         list(draft.probs), draft.match_len)
        return found

    def _feed(self, req_id: str, context: np.ndarray, num_prompt_tokens: int) -> None:
        """Start the request's tree from its prompt when it is new, then add
        the output tokens the cache has not seen."""
        fed = self.fed.get(req_id)
        if fed is None or fed > len(context):
            if req_id in self.cache.active_requests:
                self.cache.stop_request(req_id)
            self.cache.start_request(
                req_id, np.ascontiguousarray(context[:num_prompt_tokens], dtype=np.int32))
            fed = num_prompt_tokens
            self.started += 1
            if self.started % LOG_CACHE_EVERY == 0:
                logger.info("selfspec suffix lookup: %s", self.describe())
        if len(context) > fed:
            self.cache.add_active_response(
                req_id, np.ascontiguousarray(context[fed:], dtype=np.int32))
        self.fed[req_id] = max(fed, len(context))

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the trees of requests vLLM no longer holds (their responses
        stay in the cache of past responses)."""
        for req_id in set(self.fed) - live_req_ids:
            del self.fed[req_id]
            self.cache.stop_request(req_id)

    def per_request_state(self) -> dict[str, int]:
        return {"suffix_trees": len(self.fed)}

    def describe(self) -> dict:
        """Trees held and the past responses' tree's estimated bytes (read
        from arctic-inference 0.3.0's private `_global_tree`: the cache has no
        public size)."""
        return {"live_requests": len(self.fed),
                "cached_responses": len(self.cache.cached_requests),
                "past_responses_bytes": self.cache._global_tree.estimate_memory()}


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
