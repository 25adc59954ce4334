"""The routing policies as pure functions: no servers, just candidates and decisions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvfleet_gateway.recent_routes import RecentRoutes
from kvfleet_gateway.routing import Candidate, choose, expected_ttft, load_bound


def cand(rid: str, **kw) -> Candidate:
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    kw.setdefault("decode_tokens_per_s", 100.0)
    return Candidate(rid, f"http://{rid}", **kw)


def test_prefix_aware_prefers_the_replica_holding_the_prefix():
    cs = [cand("a#1"), cand("b#1", matched_tokens=2000), cand("c#1", matched_tokens=500)]
    d = choose("prefix-aware", cs, prompt_tokens=2200, counter=0)
    assert d.chosen.replica_id == "b#1"
    assert [c.replica_id for c in d.ranked] == ["b#1", "c#1", "a#1"]
    assert d.scores["b#1"] == pytest.approx(200 / 1000)
    assert d.explain()[0] == {"replica": "b#1", "score": 0.2, "matched_tokens": 2000, "indexed_tokens": 0,
                              "inflight": 0, "queued_tokens": 0, "running": 0, "waiting": 0}  # fmt: skip
    # the others pay their own recompute twice: once as latency, once as cache affinity
    assert d.scores["a#1"] == pytest.approx(2200 / 1000 + 2000 / 1000)
    assert d.scores["c#1"] == pytest.approx(1700 / 1000 + 1500 / 1000)


def test_a_hot_prefix_spreads_once_waiting_costs_more_than_twice_the_recompute():
    # b holds 2,000 of 2,200 tokens; on idle a the request would take 2.2 s, and the prefix would live
    # twice. b with 2,500 tokens queued (2.8 s) is slower for this request but keeps the group together.
    warm = cand("b#1", matched_tokens=2000, queued_tokens=2500, inflight=3)
    assert choose("prefix-aware", [cand("a#1"), warm], 2200, 0).chosen.replica_id == "b#1"
    # once its queue costs more than recomputing twice (4.2 s), the prefix spreads
    hot = cand("b#1", matched_tokens=2000, queued_tokens=4500, inflight=3)
    assert choose("prefix-aware", [cand("a#1"), hot], 2200, 0).chosen.replica_id == "a#1"


def test_simulated_burst_of_one_hot_prefix_uses_several_replicas():
    """Route 40 simultaneous requests sharing a prefix, updating queues as a gateway would."""
    replicas = {r: cand(r) for r in ("a#1", "b#1", "c#1", "d#1")}
    cached: set[str] = set()
    chosen = Counter()
    for i in range(40):
        for rid, c in replicas.items():
            c.matched_tokens = 2000 if rid in cached else 0
        d = choose("prefix-aware", list(replicas.values()), 2200, i)
        c = d.chosen
        c.queued_tokens += 2200 - c.matched_tokens
        c.inflight += 1
        cached.add(c.replica_id)
        chosen[c.replica_id] += 1
    assert len(chosen) >= 3  # it spread...
    assert max(chosen.values()) <= 0.5 * 40  # ...and no replica took most of the burst


def test_equal_replicas_take_turns():
    cs = [cand("a#1"), cand("b#1"), cand("c#1")]
    picks = [choose("prefix-aware", cs, 100, i).chosen.replica_id for i in range(6)]
    assert Counter(picks) == {"a#1": 2, "b#1": 2, "c#1": 2}


def test_rates_are_pooled_over_the_models_replicas():
    fresh = cand("new#1", prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0)
    known = cand("old#1", prefill_tokens_per_s=4000.0, decode_tokens_per_s=200.0, inflight=1)
    d = choose("prefix-aware", [fresh, known], 1000, 0)
    assert d.scores["new#1"] == pytest.approx(1000 / 4000)  # unmeasured: the peers' rate
    assert d.scores["old#1"] == pytest.approx(1000 / 4000 + 1 / 200)
    assert d.chosen.replica_id == "new#1"
    slow = cand("b#1", prefill_tokens_per_s=1000.0)
    assert choose("prefix-aware", [cand("a#1", prefill_tokens_per_s=3000.0), slow], 100, 0).scores == {
        "a#1": pytest.approx(100 / 2000),
        "b#1": pytest.approx(100 / 2000),
    }


def test_kv_pressure_is_penalised():
    # a full replica holding a little of the prompt loses to an idle one: new work there preempts
    full = cand("a#1", matched_tokens=200, kv_usage=0.99)
    assert expected_ttft(full, 1100, 1000, 100) > expected_ttft(cand("b#1"), 1100, 1000, 100)
    assert choose("prefix-aware", [full, cand("b#1")], 1100, 0).chosen.replica_id == "b#1"


def test_least_load_and_round_robin():
    cs = [
        cand("a#1", inflight=3),
        cand("b#1", inflight=1, matched_tokens=900),
        cand("c#1", inflight=1, running=5),
    ]
    assert choose("least-load", cs, 1000, 0).chosen.replica_id == "b#1"
    picks = [choose("round-robin", cs, 1000, i).chosen.replica_id for i in range(6)]
    assert picks == ["a#1", "b#1", "c#1", "a#1", "b#1", "c#1"]


def test_bad_input():
    with pytest.raises(ValueError, match="no candidates"):
        choose("prefix-aware", [], 10, 0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose("random", [cand("a#1")], 10, 0)


def test_near_equal_predictions_are_ties_so_an_idle_fleet_spreads_small_requests():
    # b's advantage is a few milliseconds (2 tokens of prefill, counted twice): noise, not a reason to send
    # it every small request
    cs = [cand("a#1"), cand("b#1", matched_tokens=2)]
    picks = Counter(choose("prefix-aware", cs, 40, i).chosen.replica_id for i in range(10))
    assert picks == {"a#1": 5, "b#1": 5}
    # a real difference is not a tie
    cs = [cand("a#1"), cand("b#1", matched_tokens=400)]
    assert {choose("prefix-aware", cs, 4000, i).chosen.replica_id for i in range(4)} == {"b#1"}
    # among ties, fewer requests in flight wins
    busy = [cand("a#1", inflight=1), cand("b#1", queued_tokens=2)]
    assert {choose("prefix-aware", busy, 40, i).chosen.replica_id for i in range(4)} == {"b#1"}


def test_upstream_payload_carries_the_tenants_priority_and_salt():
    import json

    from kvfleet_common.openai_protocol import ChatCompletionRequest
    from kvfleet_common.schemas import TenantRecord
    from kvfleet_gateway.upstream_request import upstream_payload

    def payload(tenant: TenantRecord, **fields) -> dict:
        sent = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()
        return json.loads(upstream_payload(sent, ChatCompletionRequest.model_validate_json(sent), tenant))

    gold = TenantRecord(name="gold", priority=5, cache_salt="s1")
    data = payload(gold, stream=True, priority=-100)
    assert data["priority"] == -5  # engine: lower runs first; a client cannot raise its own priority
    assert data["cache_salt"] == "s1"
    assert data["stream_options"] == {"include_usage": True}
    assert data["messages"] == [{"role": "user", "content": "hi"}] and data["model"] == "m"
    data = payload(gold, priority=3, cache_salt="c")
    assert data["priority"] == -2  # ...but may lower it
    assert data["cache_salt"] == "s1\x1fc"  # a client salt extends the tenant's, never replaces it
    assert "stream_options" not in data
    shared = TenantRecord(name="shared")
    assert payload(shared, priority=3).get("cache_salt") is None


def test_a_holder_under_kv_pressure_still_attracts_its_group():
    # a holds 2,000 of 2,200 tokens and its KV is nearly all in use; b is idle. Its pressure costs a
    # second (KV_PRESSURE_PENALTY_S), but sending the group to b recomputes 2.2 s, splits the group and
    # evicts about as much of whatever b caches: a keeps it
    full = cand("a#1", matched_tokens=2000, kv_usage=0.99)
    d = choose("prefix-aware", [full, cand("b#1")], 2200, 0)
    assert d.chosen.replica_id == "a#1"
    assert d.scores["a#1"] == pytest.approx(200 / 1000 + 1.0)
    assert d.scores["b#1"] == pytest.approx(2200 / 1000 + 2000 / 1000)  # b's KV is empty: nothing evicted


def test_under_cache_pressure_a_group_moves_only_when_waiting_costs_about_three_recomputes():
    """Every copy of a prefix on a full cache evicts another group's: the copy costs its recompute, the
    split, and the evicted tokens (EVICTION_WEIGHT x the target's KV usage), so a group waits longer for
    its replica than on an idle fleet before it moves."""

    def pick(queued: int, kv_usage: float) -> str:
        holder = cand("b#1", matched_tokens=2000, queued_tokens=queued, inflight=3, kv_usage=kv_usage)
        other = cand("a#1", kv_usage=kv_usage)
        return choose("prefix-aware", [other, holder], 2200, 0).chosen.replica_id

    # idle caches: the group spreads once its queue costs more than twice the recompute (4.2 s)
    assert pick(3500, kv_usage=0.0) == "b#1"
    assert pick(4500, kv_usage=0.0) == "a#1"
    # full caches (both above KV_PRESSURE_THRESHOLD, so the penalty cancels out): it stays at 4.5 s and
    # at 5.8 s, and moves once waiting costs more than recompute + split + eviction (~6.1 s)
    assert pick(4500, kv_usage=0.97) == "b#1"
    assert pick(5800, kv_usage=0.97) == "b#1"
    assert pick(6500, kv_usage=0.97) == "a#1"


def test_a_near_tie_does_not_copy_a_prefix():
    # a (no prefix, 2 in flight) and b (holds 2,000 tokens, 4 in flight) predict 9.20 s and 9.24 s:
    # within TIE_FRACTION, so by load alone a would win and copy the group's prefix. A tie cannot tell
    # them apart on time, and then not copying is better: b keeps the group.
    holder = cand("b#1", matched_tokens=2000, queued_tokens=9000, inflight=4)
    other = cand("a#1", queued_tokens=4980, inflight=2)
    d = choose("prefix-aware", [other, holder], 2200, 0)
    assert d.scores["a#1"] < d.scores["b#1"] <= 1.05 * d.scores["a#1"]
    assert [c.replica_id for c in d.ranked] == ["b#1", "a#1"]
    # two replicas holding the same prefix are still a tie, broken by load
    twin = cand("a#1", matched_tokens=2000, queued_tokens=9000, inflight=3)
    assert choose("prefix-aware", [twin, holder], 2200, 1).chosen.replica_id == "a#1"


def _route_burst(recent: RecentRoutes | None, groups: int, per_group: int) -> dict[int, Counter]:
    """Interleaved arrivals of prompt groups (1,024 shared tokens + 64 own) on 4 idle replicas whose KV
    index has not caught up yet (it shows nothing), updating queues as a gateway would."""
    replicas = {r: cand(r) for r in ("a#1", "b#1", "c#1", "d#1")}
    where: dict[int, Counter] = {g: Counter() for g in range(groups)}
    for i in range(groups * per_group):
        g = i % groups
        hashes = [f"g{g}-{b}".encode() for b in range(64)]  # 64 blocks of 16 = 1,024 shared tokens
        for c in replicas.values():
            c.matched_tokens = (
                16 * recent.matched_blocks(c.replica_id, hashes, now=i * 0.01) if recent is not None else 0
            )
        d = choose("prefix-aware", list(replicas.values()), 1088, i)
        c = d.chosen
        c.queued_tokens += 1088 - c.matched_tokens
        c.inflight += 1
        if recent is not None:
            recent.record(c.replica_id, hashes, now=i * 0.01)
        where[g][c.replica_id] += 1
    return where


def test_a_burst_of_new_prompt_groups_sticks_before_the_index_knows():
    """The KV index lags an engine step; without a memory of its own routes, the gateway scatters every
    group of a burst over the fleet (each replica recomputes each prefix). With it, each group stays on
    one replica, and the groups spread over the fleet."""
    scattered = _route_burst(None, groups=3, per_group=4)
    assert all(len(replicas) >= 3 for replicas in scattered.values()), scattered
    sticky = _route_burst(RecentRoutes(ttl_s=30), groups=3, per_group=4)
    assert all(len(replicas) == 1 for replicas in sticky.values()), sticky
    assert len({next(iter(r)) for r in sticky.values()}) == 3  # each group on its own replica


def test_recent_routes_match_expire_forget_and_stay_bounded():
    r = RecentRoutes(ttl_s=10, max_hashes=5)
    h = [bytes([i]) for i in range(4)]
    r.record("a#1", h[:3], now=0)
    r.record("b#1", h[:1], now=5)
    assert r.matched_blocks("a#1", h, now=1) == 3  # leading blocks only, up to the first unknown
    assert r.matched_blocks("b#1", h, now=1) == 1
    assert r.matched_blocks("a#1", h, now=10) == 0  # expired (10 s after it was routed)
    assert r.matched_blocks("b#1", h, now=10) == 1
    r.forget("b#1", h[:1])
    assert r.matched_blocks("b#1", h, now=10) == 0
    r.record("a#1", [bytes([i]) for i in range(10, 20)], now=11)
    assert len(r) == 5  # bounded: the least recently routed are forgotten first
    assert r.matched_blocks("a#1", [bytes([i]) for i in range(15, 20)], now=11) == 5
    r.forget("a#1")
    assert len(r) == 0
    off = RecentRoutes(ttl_s=0)
    off.record("a#1", h, now=0)
    assert off.matched_blocks("a#1", h, now=0) == 0


def test_bounded_load_caps_a_replicas_share_whatever_its_cache_holds():
    # b holds the prefix and is the best by TTFT + affinity, but has 12 in flight against a mean of 4.25
    busy = cand("b#1", matched_tokens=2000, inflight=12)
    others = [cand("a#1", inflight=0), cand("c#1", inflight=0), cand("d#1", inflight=4)]
    d = choose("prefix-aware", [busy, *others], 2200, 0)
    assert load_bound([busy, *others]) == 6  # ceil(1.25 x 17 / 4)
    assert d.chosen.replica_id in ("a#1", "c#1") and d.ranked[1].replica_id == "b#1"
    # a quiet fleet keeps a group together: up to BOUNDED_LOAD_MIN in flight is never over the bound
    quiet = cand("b#1", matched_tokens=2000, inflight=3)
    assert choose("prefix-aware", [quiet, cand("a#1")], 2200, 0).chosen.replica_id == "b#1"


@pytest.mark.parametrize("kv_usage", [0.0, 0.97])
def test_a_sustained_hot_prefix_is_balanced_over_the_fleet(kv_usage: float):
    """One prefix at a steady rate, requests finishing after a fixed time: it spreads, and no replica takes
    more than 1.5x the mean (the issue's target for a hot prefix). Without the load bound the holder
    would take all of it (a miss costs 4.2 s of prefill + affinity, a hit only its queue). Also with full
    KV caches, where a copy costs more (eviction) and the score alone would spread it later still."""
    replicas = {r: cand(r, kv_usage=kv_usage) for r in ("a#1", "b#1", "c#1", "d#1")}
    recent = RecentRoutes(ttl_s=30)
    hashes = [f"hot-{b}".encode() for b in range(125)]  # 2,000 shared tokens
    running: list[tuple[float, str]] = []  # (finish time, replica)
    served = Counter()
    for i in range(400):
        now = i * 0.2  # 5 requests/s; each is in flight 3 s
        for t, rid in [x for x in running if x[0] <= now]:
            running.remove((t, rid))
            replicas[rid].inflight -= 1
        for c in replicas.values():
            c.matched_tokens = 16 * recent.matched_blocks(c.replica_id, hashes, now)
        c = choose("prefix-aware", list(replicas.values()), 2200, i).chosen
        recent.record(c.replica_id, hashes, now)
        c.inflight += 1
        running.append((now + 3.0, c.replica_id))
        served[c.replica_id] += 1
    assert len(served) >= 3
    assert max(served.values()) <= 1.5 * 400 / 4, served


def test_many_prompt_groups_on_full_caches_stay_on_their_replicas():
    """16 prompt groups (2,000 shared tokens + 200 own) arrive in a random order at 5 requests/s on 4
    replicas prefilling 800 tokens/s each, every KV cache nearly full (the bench's shared-prefix under
    pressure). Each group's prefix is computed about once: a copy would evict another group's prefix.
    The load stays balanced, because the groups, not the requests, spread. (The copies left are the load
    bound's, for a hot prefix: before, with affinity off on full caches, prefixes were copied 12 times.)"""
    rng = random.Random(0)
    replicas = {r: cand(r, prefill_tokens_per_s=800.0, kv_usage=0.97) for r in ("a#1", "b#1", "c#1", "d#1")}
    arrivals = [g for g in range(16) for _ in range(8)]
    rng.shuffle(arrivals)
    holds: set[tuple[str, int]] = set()
    served = Counter()
    for i, g in enumerate(arrivals):
        for c in replicas.values():  # 0.2 s between arrivals: each replica prefilled 160 tokens
            c.queued_tokens = max(0, c.queued_tokens - 160)
            c.inflight = -(-c.queued_tokens // 215)
            c.matched_tokens = 2000 if (c.replica_id, g) in holds else 0
        c = choose("prefix-aware", list(replicas.values()), 2200, i).chosen
        c.queued_tokens += 2200 - c.matched_tokens
        holds.add((c.replica_id, g))
        served[c.replica_id] += 1
    assert len(holds) <= 16 + 4, sorted(holds)  # at most a quarter of the groups copied
    assert max(served.values()) <= 1.5 * len(arrivals) / 4, served
