"""Routing policy: pure functions from what the gateway knows about each candidate replica to a choice.

No I/O here. The gateway gathers the facts (heartbeats, one Redis round trip for prefix matches and the
other gateways' load, its own in-flight counts) into ``Candidate`` objects and calls ``choose``.

``prefix-aware`` (the default) picks the lowest expected time to first token::

    ttft(r) = (queued_prompt_tokens(r) + uncached_prompt_tokens(r)) / prefill_rate(r)   # prefill work ahead + ours
            + inflight(r) / decode_rate(r)                                          # ~ one step of the current batch

- ``uncached_prompt_tokens`` comes from the request's block hashes and the replica's KV index: the
  prediction is exact (same tokenizer, template, hashing and salt as the engine), up to the index's lag.
- ``queued_prompt_tokens`` are prompt tokens the gateways routed to ``r`` that have not produced a first
  token yet. The gateways know them the moment they route (heartbeats are ~1 s old), so a burst of
  requests sharing a hot prefix raises its replica's score at once and the prefix spreads to a second
  replica as soon as waiting there would cost more than recomputing the prefix elsewhere.
- ``inflight / decode_rate`` is the current step time of a decode batch of that size (the engine's
  decode rate is requests-tokens per second over the whole batch), so a replica busy decoding long
  answers looks slower even when its prefill queue is empty.
- Rates come from the engines' measured EMAs, pooled over the model's replicas (their mean). Replicas
  of one model run the same engine on the same hardware, so per-replica differences are mostly the
  mix of work each happened to measure (a replica that only saw short prompts measures a lower
  tokens/s, dominated by per-step overhead); letting them steer traffic made an idle fleet send every
  request to whichever replica had measured best. A model with no measurement yet uses
  ``DEFAULT_PREFILL_TOKENS_PER_S``.
- A replica whose KV cache is nearly full is penalised: new work there will preempt running requests.

The score adds one more term to the expected TTFT, **cache affinity**::

    score(r) = ttft(r) + copy_cost(r) * (best_matched - matched(r)) / prefill_rate
    copy_cost(r) = CACHE_AFFINITY + EVICTION_WEIGHT * kv_usage(r)

Sending a request away from the replica that holds its prefix costs more than this request's
recompute (already in ``ttft``): the prefix now occupies KV memory on two replicas, and the group's
later requests split their hits between them. Counting the recompute a second time keeps a prompt group
together until waiting for its replica costs more than twice the recompute, which is when spreading
it pays. (Measured in ``bench/routing.py``: without it, a greedy per-request TTFT choice scattered
groups during a burst.) ``matched`` is the larger of the KV index's match and the prefix this gateway
routed there in the last seconds (``recent_routes``), so a burst sticks before the index catches up.

**Under cache pressure affinity counts more, never less.** Each copy of a prefix takes KV blocks on its
new replica, and when that cache is full the blocks come from another group's cached prefix, which that
group then recomputes: the copy costs its own recompute, the split, and about as many evicted tokens.
The gateway does not see how full a replica's prefix cache is, only ``kv_usage`` (the share of blocks
running requests hold; the rest is the cache); the fuller it is, the likelier a copy evicts something
still in use, so the eviction is charged as ``EVICTION_WEIGHT * kv_usage`` recomputes of the copied
tokens. On an idle replica it adds almost nothing; on a full one a group moves only when waiting for its
replica costs about three times the recompute. Every holder attracts, also one under KV pressure: its
match is still the cheapest place for this request (a hit adds a few blocks, a miss a whole prompt),
and its pressure is already in ``ttft`` as ``KV_PRESSURE_PENALTY_S``. (Measured in ``bench/routing.py``
shared-prefix, 16 groups on 4 replicas of 768 blocks: with affinity switched off for replicas above
``KV_PRESSURE_THRESHOLD``, as before, most replicas were above it for the second half of the run and
their groups were copied to whichever queue was shorter: six of the ten requests that left their group's
replica, and the hit rate was 65-67 % against 78 % for vLLM's router, which never moves a group.)

Last, **bounded load** (``bounded_load``): a replica with more than ``BOUNDED_LOAD_FACTOR`` x the mean
requests in flight does not take the request, whatever its cache holds; the best-ranked one under the
bound does. Affinity is right for many prompt groups and wrong for one hot prefix: there the TTFT rule
stops spreading as soon as two replicas keep up, and the others idle.

``least-load`` picks the fewest requests in flight (gateway counts, fresh) then the fewest the engine
reports running + waiting; ``round-robin`` rotates through the candidates (per gateway).
Scores within ``TIE_TOLERANCE_S`` / ``TIE_FRACTION`` of the best are ties, broken by fewer requests in
flight and then by a per-request rotation, so equal replicas share work. A replica that would recompute
more than ``TIE_TOLERANCE_S`` of prefix that a tied one holds is not tied with it: the prediction
cannot tell them apart on time, and then not copying the prefix is the better choice. (Under load,
``TIE_FRACTION`` of a 10 s score is half a second; breaking such ties by load alone moved groups.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
DEFAULT_DECODE_TOKENS_PER_S = 50.0
KV_PRESSURE_THRESHOLD = 0.95  # above this KV usage, admitting more work means preempting someone
KV_PRESSURE_PENALTY_S = 1.0
# Predictions closer than this are a tie: measured rates are noisy EMAs, and without a tolerance a
# replica that happened to measure 2 % faster would take every small request of an idle fleet.
TIE_TOLERANCE_S = 0.005
TIE_FRACTION = 0.05
CACHE_AFFINITY = 1.0  # extra weight of a prefix recompute (see the module docstring)
EVICTION_WEIGHT = 1.0  # ... and of the evictions a copy causes, times the target's KV usage
BOUNDED_LOAD_FACTOR = 1.25  # no replica takes a request above this x the mean in flight (``bounded_load``)
BOUNDED_LOAD_MIN = 4  # ... unless it has fewer than this: a quiet fleet keeps groups together

POLICIES = ("prefix-aware", "least-load", "round-robin")


@dataclass(slots=True)
class Candidate:
    """One awake replica of the model, with everything the policies look at."""

    replica_id: str
    base_url: str
    matched_tokens: int = 0  # leading prompt tokens the replica caches or will (blocks x block size)
    indexed_tokens: int = 0  # of them, what the KV index confirms (the rest: routed there just now)
    inflight: int = 0  # requests in flight to it from every gateway
    queued_tokens: int = 0  # prompt tokens routed to it (every gateway) still waiting for a first token
    running: int = 0  # engine-reported, ~1 s old
    waiting: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclass(slots=True)
class Decision:
    """The chosen replica, the order to try the others in (retries before the first byte), and why."""

    policy: str
    ranked: list[Candidate]  # best first; ranked[0] is the choice
    scores: dict[str, float] = field(default_factory=dict)  # replica id -> score (lower is better)
    prompt_tokens: int = 0

    @property
    def chosen(self) -> Candidate:
        return self.ranked[0]

    def explain(self) -> list[dict]:
        """Per candidate, in rank order: what the choice was based on (debug header, span attributes)."""
        return [
            {"replica": c.replica_id, "score": round(self.scores.get(c.replica_id, 0.0), 6),
             "matched_tokens": c.matched_tokens, "indexed_tokens": c.indexed_tokens, "inflight": c.inflight,
             "queued_tokens": c.queued_tokens,
             "running": c.running, "waiting": c.waiting}
            for c in self.ranked
        ]  # fmt: skip


def expected_ttft(c: Candidate, prompt_tokens: int, prefill_rate: float, decode_rate: float) -> float:
    """Seconds until ``c`` would produce this request's first token (see the module docstring)."""
    uncached = max(0, prompt_tokens - c.matched_tokens)
    seconds = (c.queued_tokens + uncached) / prefill_rate + c.inflight / decode_rate
    if c.kv_usage >= KV_PRESSURE_THRESHOLD:
        seconds += KV_PRESSURE_PENALTY_S
    return seconds


def _fallback_rate(values: Sequence[float], default: float) -> float:
    known = [v for v in values if v > 0]
    return sum(known) / len(known) if known else default


def _rotated(candidates: Sequence[Candidate], start: int) -> list[Candidate]:
    n = len(candidates)
    return [candidates[(start + i) % n] for i in range(n)]


def choose(policy: str, candidates: Sequence[Candidate], prompt_tokens: int, counter: int) -> Decision:
    """Rank ``candidates`` (non-empty) for a request of ``prompt_tokens`` under ``policy``.

    ``counter`` is a per-gateway request counter: round-robin's position, and the rotation that breaks
    ties in the other policies (so identical replicas take turns instead of the first one taking all).
    """
    if not candidates:
        raise ValueError("no candidates to choose from")
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
    order = _rotated(sorted(candidates, key=lambda c: c.replica_id), counter)
    if policy == "round-robin":
        return Decision(policy, order, {c.replica_id: float(i) for i, c in enumerate(order)}, prompt_tokens)
    if policy == "least-load":
        scores = {c.replica_id: c.inflight + (c.running + c.waiting) / 1000.0 for c in order}
    else:
        prefill = _fallback_rate([c.prefill_tokens_per_s for c in order], DEFAULT_PREFILL_TOKENS_PER_S)
        decode = _fallback_rate([c.decode_tokens_per_s for c in order], DEFAULT_DECODE_TOKENS_PER_S)
        scores = {c.replica_id: expected_ttft(c, prompt_tokens, prefill, decode) for c in order}
        best_matched = max(min(c.matched_tokens, prompt_tokens) for c in order)
        for c in order:
            missing = max(0, best_matched - min(c.matched_tokens, prompt_tokens))
            copy_cost = CACHE_AFFINITY + EVICTION_WEIGHT * min(1.0, max(0.0, c.kv_usage))
            scores[c.replica_id] += copy_cost * missing / prefill
        ranked = bounded_load(_break_ties(order, scores, prompt_tokens, prefill))
        return Decision(policy, ranked, scores, prompt_tokens)
    ranked = sorted(order, key=lambda c: scores[c.replica_id])  # stable: equal scores keep the rotation
    return Decision(policy, ranked, scores, prompt_tokens)


def _break_ties(
    order: list[Candidate], scores: dict[str, float], prompt_tokens: int, prefill: float
) -> list[Candidate]:
    """``order`` (the rotation) ranked by score, where scores within the tie tolerance of the best go by
    fewer requests in flight, then the rotation; a replica missing more than ``TIE_TOLERANCE_S`` of
    prefill that another tied one holds is not tied with it (see the module docstring)."""
    ranked = sorted(order, key=lambda c: scores[c.replica_id])  # stable: equal scores keep the rotation
    best = scores[ranked[0].replica_id]
    limit = best + max(TIE_TOLERANCE_S, TIE_FRACTION * best)
    tied = [c for c in ranked if scores[c.replica_id] <= limit]
    if len(tied) < 2:
        return ranked
    most = max(min(c.matched_tokens, prompt_tokens) for c in tied)
    tied = [c for c in tied if (most - min(c.matched_tokens, prompt_tokens)) / prefill <= TIE_TOLERANCE_S]
    position = {c.replica_id: i for i, c in enumerate(order)}
    tied.sort(key=lambda c: (c.inflight, position[c.replica_id]))
    first = {c.replica_id for c in tied}
    return tied + [c for c in ranked if c.replica_id not in first]


def load_bound(candidates: Sequence[Candidate]) -> int:
    """The most requests in flight a replica may have and still take one more (see ``bounded_load``)."""
    total = sum(c.inflight for c in candidates)
    return max(BOUNDED_LOAD_MIN, math.ceil(BOUNDED_LOAD_FACTOR * (total + 1) / len(candidates)))


def bounded_load(ranked: list[Candidate]) -> list[Candidate]:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), applied to the
    ranking: the best-ranked replica that would stay within ``BOUNDED_LOAD_FACTOR`` x the mean requests
    in flight goes first.

    Cache affinity and the prefix memory keep a prompt group on its replica, which is right for many
    groups and wrong for one hot prefix: there the per-request TTFT rule stops spreading as soon as two
    replicas keep up, and the others idle. The bound caps any replica's share of the traffic whatever
    its cache holds; a request over it pays a recompute elsewhere, which seeds the hot prefix there."""
    bound = load_bound(ranked)
    for i, c in enumerate(ranked):
        if c.inflight + 1 <= bound:
            return ranked if i == 0 else [c, *ranked[:i], *ranked[i + 1 :]]
    return ranked
