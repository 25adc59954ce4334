"""The routing policies as pure functions: no servers, just candidates and decisions."""

from __future__ import annotations

from collections import Counter

import pytest

from kvfleet_gateway.routing import Candidate, choose, expected_ttft


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
    assert d.explain()[0] == {"replica": "b#1", "score": 0.2, "matched_tokens": 2000, "inflight": 0,
                              "queued_tokens": 0, "running": 0, "waiting": 0}  # fmt: skip


def test_a_hot_prefix_spreads_once_waiting_costs_more_than_recomputing():
    # b holds the prefix but has 2,500 prompt tokens queued: recomputing 2,200 on idle a is faster
    hot = cand("b#1", matched_tokens=2000, queued_tokens=2500, inflight=10)
    d = choose("prefix-aware", [cand("a#1"), hot], prompt_tokens=2200, counter=0)
    assert d.chosen.replica_id == "a#1"
    # with a shorter queue the prefix still wins
    warm = cand("b#1", matched_tokens=2000, queued_tokens=600, inflight=3)
    assert choose("prefix-aware", [cand("a#1"), warm], 2200, 0).chosen.replica_id == "b#1"


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
    full = cand("a#1", matched_tokens=500, kv_usage=0.99)
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
    # b caches 16 of 40 tokens: a few milliseconds, not a reason to send it every small request
    cs = [cand("a#1"), cand("b#1", matched_tokens=3)]
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
    from kvfleet_gateway.proxy import upstream_payload

    gold = TenantRecord(name="gold", priority=5, cache_salt="s1")
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, priority=-100
    )
    data = json.loads(upstream_payload(req, gold))
    assert data["priority"] == -5  # engine: lower runs first; a client cannot raise its own priority
    assert data["cache_salt"] == "s1"
    assert data["stream_options"] == {"include_usage": True}
    assert data["messages"] == [{"role": "user", "content": "hi"}] and data["model"] == "m"
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], priority=3, cache_salt="c"
    )
    data = json.loads(upstream_payload(req, gold))
    assert data["priority"] == -2  # ...but may lower it
    assert data["cache_salt"] == "s1\x1fc"  # a client salt extends the tenant's, never replaces it
    assert "stream_options" not in data
    shared = TenantRecord(name="shared")
    assert "cache_salt" not in json.loads(
        upstream_payload(req.model_copy(update={"cache_salt": None}), shared)
    )
