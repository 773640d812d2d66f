"""Where a request's tokens came from: its own self-draft, a lookup in its own
text, or no draft at all (a round that declined to draft); and of the
self-drafts, how many the method's own mechanism made (skipped layers, an
early exit: `mechanism`) rather than the full-depth base draft.

The worker knows where each draft came from; vLLM's scheduler knows what was
verified and accepted. So the worker's draft ids carry one code per draft
token (`SourcedDraftTokenIds`, codes from `draft/tokens.py`), the scheduler
labels each request's pending drafts with them, and where vLLM counts a
verification it is counted again per source (accepted drafts are a prefix of
the verified ones, so the codes of that prefix say whose they were):
- per request in `RequestSpecDecodeMetrics.token_sources`, which vLLM returns
  as `metrics.speculative_decoding.token_sources` in each response when the
  server runs with `--per-request-spec-decode-metrics summary`;
- per step in `SpecDecodingStats.token_sources`, which the front end adds to
  the `vllm:selfspec_*` counters on /metrics.
A step that verifies no draft (rounds that declined) still reports its
counts, in spec-decode stats of its own that count no draft. Keys: `<source>_rounds` for source in self, lookup,
none, and `<source>_drafted`, `<source>_accepted` for self, lookup and
mechanism (a part of self); a few integers per request, gone with the request.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from vllm.v1.outputs import DraftTokenIds

from vllm_selfspec.draft.tokens import LOOKUP, MECHANISM
from vllm_selfspec.integration.patches import original

DRAFT_SOURCES = ("self", "lookup")
SOURCES = (*DRAFT_SOURCES, "none")  # "none": the round drafted nothing
# The self-drafts the method's own mechanism made (counted within "self").
MECHANISM_SOURCE = "mechanism"
_SCHEDULER = ("vllm.v1.core.sched.scheduler", "Scheduler")


@dataclasses.dataclass
class SourcedDraftTokenIds(DraftTokenIds):
    """vLLM's draft ids plus, per request, one source code per draft."""

    sources: list[str] = dataclasses.field(default_factory=list)


def add_counts_field(cls: type) -> None:
    """Give vLLM dataclass `cls` a `token_sources: dict[str, int]` field (empty
    by default), in place, so vLLM's msgspec serialisation between the engine
    core and the front end carries it. Idempotent."""
    fields = dataclasses.fields(cls)
    if any(f.name == "token_sources" for f in fields):
        return
    params = cls.__dataclass_params__
    for existing in fields:  # dataclass() removed factory defaults from the class
        setattr(cls, existing.name, existing)
    cls.__annotations__["token_sources"] = dict[str, int]
    cls.token_sources = dataclasses.field(default_factory=dict)
    for generated in ("__init__", "__repr__", "__eq__", "__match_args__"):
        if generated in vars(cls):
            delattr(cls, generated)
    dataclasses.dataclass(cls, init=params.init, repr=params.repr, eq=params.eq,
                          order=params.order, unsafe_hash=params.unsafe_hash,
                          frozen=params.frozen)


def _count(scheduler: Any, request: Any, key: str, amount: int) -> None:
    metrics = getattr(request, "spec_decode_metrics", None)
    if metrics is not None:
        metrics.token_sources[key] = metrics.token_sources.get(key, 0) + amount
    pending = vars(scheduler).setdefault("selfspec_pending_sources", Counter())
    pending[key] += amount


def update_draft_token_ids(self: Any, draft_token_ids: DraftTokenIds) -> None:
    """vLLM's, then each request's new drafts labelled with their source."""
    original(*_SCHEDULER, "update_draft_token_ids")(self, draft_token_ids)
    if not isinstance(draft_token_ids, SourcedDraftTokenIds):
        return  # not one of our methods
    for req_id, codes in zip(draft_token_ids.req_ids, draft_token_ids.sources):
        request = self.requests.get(req_id)
        if request is None or request.is_finished() or request.is_prefill_chunk:
            continue
        source = (("lookup" if codes.startswith(LOOKUP) else "self")
                  if request.spec_token_ids else "none")
        request.selfspec_draft_source = source
        request.selfspec_draft_codes = codes
        _count(self, request, f"{source}_rounds", 1)


def make_spec_decoding_stats(self: Any, spec_decoding_stats: Any, num_draft_tokens: int,
                             num_accepted_tokens: int,
                             num_invalid_spec_tokens: dict[str, int] | None,
                             request_id: str) -> Any:
    """vLLM's count of one verification, then the same per source; the
    step's stats take the source counts gathered since the last ones."""
    stats = original(*_SCHEDULER, "make_spec_decoding_stats")(
        self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
        num_invalid_spec_tokens, request_id)
    request = self.requests.get(request_id)
    source = getattr(request, "selfspec_draft_source", None)
    if source in DRAFT_SOURCES and num_draft_tokens:
        drafted = num_draft_tokens - (num_invalid_spec_tokens or {}).get(request_id, 0)
        _count(self, request, f"{source}_drafted", drafted)
        _count(self, request, f"{source}_accepted", num_accepted_tokens)
        codes = request.selfspec_draft_codes
        by_mechanism = codes[:drafted].count(MECHANISM)
        if by_mechanism:
            _count(self, request, f"{MECHANISM_SOURCE}_drafted", by_mechanism)
            _count(self, request, f"{MECHANISM_SOURCE}_accepted",
                   codes[:num_accepted_tokens].count(MECHANISM))
    pending = vars(self).get("selfspec_pending_sources")
    if stats is not None and pending:
        for key, amount in pending.items():
            stats.token_sources[key] = stats.token_sources.get(key, 0) + amount
        pending.clear()
    return stats


def make_stats(self: Any, spec_decoding_stats: Any = None, kv_connector_stats: Any = None,
               cudagraph_stats: Any = None, perf_stats: Any = None,
               ec_connector_stats: Any = None) -> Any:
    """vLLM's; a step that verified no draft still reports the rounds counted
    since the last report, in spec-decode stats of its own that count no
    draft. Under load most rounds decline, and their counts would otherwise
    wait for the next verification, landing in a later benchmark run than
    their own (or never, for a server's last requests)."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    pending = vars(self).get("selfspec_pending_sources")
    if spec_decoding_stats is None and pending and self.log_stats:
        spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        spec_decoding_stats.token_sources.update(pending)
        pending.clear()
    return original(*_SCHEDULER, "make_stats")(
        self, spec_decoding_stats, kv_connector_stats, cudagraph_stats, perf_stats,
        ec_connector_stats=ec_connector_stats)


def log_verifying_steps(self: Any, spec_decoding_stats: Any) -> None:
    """vLLM's acceptance log, fed only the steps that verified drafts: a step
    that only reports declined rounds (`make_stats`) would log an interval
    without drafts as an acceptance of 0/0."""
    if spec_decoding_stats.num_drafts:
        original("vllm.v1.spec_decode.metrics", "SpecDecodingLogging", "observe")(
            self, spec_decoding_stats)


def request_metrics_to_dict(self: Any) -> dict[str, Any]:
    """vLLM's per-request summary, plus `token_sources` when there are any."""
    result = original("vllm.v1.metrics.stats", "RequestSpecDecodeMetrics", "to_dict")(self)
    if self.token_sources:
        result["token_sources"] = dict(self.token_sources)
    return result


_COUNTERS: dict[str, Any] = {}


def _counter(kind: str) -> Any:
    """`vllm:selfspec_<kind>_total{source=...}`, made once per process."""
    if kind not in _COUNTERS:
        import prometheus_client

        what = {"rounds": "Request-rounds by the source of their drafts (none: declined)",
                "drafted": "Draft tokens verified, by source",
                "accepted": "Draft tokens accepted, by source"}[kind]
        name = {"drafted": "draft_tokens", "accepted": "accepted_tokens"}.get(kind, kind)
        _COUNTERS[kind] = prometheus_client.Counter(
            f"vllm:selfspec_{name}", f"vllm-selfspec: {what}.", labelnames=["source"])
    return _COUNTERS[kind]


def observe_spec_decoding(self: Any, spec_decoding_stats: Any, engine_idx: int = 0) -> None:
    """vLLM's spec-decode counters, then ours by source."""
    original("vllm.v1.spec_decode.metrics", "SpecDecodingProm", "observe")(
        self, spec_decoding_stats, engine_idx)
    for key, amount in spec_decoding_stats.token_sources.items():
        source, kind = key.rsplit("_", 1)
        _counter(kind).labels(source=source).inc(amount)
