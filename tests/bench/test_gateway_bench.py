"""``bench/routing.py`` and ``bench/gateway_overhead.py``: each runs end to end in ``--quick`` mode against a real
Redis, real simulated replicas and a real gateway, and writes its JSON with the expected keys (no performance
assertions); plus their pure helpers (workload building, capacity calibration, statistics, profile summary)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bench import _fleet as fleet
from bench import _fleet_client as fleet_client
from bench import _fleet_metrics as fleet_metrics
from bench import _gateway_overhead_load as overhead_load
from bench import _gateway_overhead_logs as overhead_logs
from bench import _gateway_overhead_profile as overhead_profile
from bench import _gateway_overhead_report as overhead_report
from bench import _gateway_overhead_stats as overhead_stats
from bench import _routing_requests as routing_requests
from bench import _routing_stats as routing_stats
from bench import _routing_workloads as routing_workloads
from bench import _serve_common as sc
from bench import _vllm_router as vllm_router
from bench import gateway_overhead as overhead
from bench import routing
from tests.sse_server import SseServer


@pytest.fixture(scope="module")
def tokenizer_and_words(demo_model):
    tok = sc.load_tokenizer(demo_model(preset="tiny"))
    return tok, sc.word_pool(tok)


# ---- end to end ------------------------------------------------------------------------------------------


def test_routing_quick_writes_every_run(tmp_path: Path, demo_model) -> None:
    out = tmp_path / "routing.json"
    # vLLM's router (issue 27's peer) runs beside kvfleet's policies where it is installed
    peer = ["vllm-router:cache_aware"] if vllm_router.version() is not None else []
    policies = ["prefix-aware", "round-robin", *peer]
    argv = ["--quick", "--model", str(demo_model(preset="tiny")), "--scenarios", "shared-prefix,multi-turn",
            "--policies", ",".join(policies), "--log-dir", str(tmp_path / "logs"),
            "--out", str(out)]  # fmt: skip
    result = routing.main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result, default=str))
    assert data["benchmark"] == "routing" and data["command"].startswith(
        ".venv/bin/python -m bench.routing --quick"
    )
    assert set(data["timing_model"]) >= {
        "prefill_ms_per_1k_tokens",
        "decode_ms_per_step",
        "num_kv_blocks",
        "replicas",
    }
    assert list(data["scenarios"]) == ["shared-prefix", "multi-turn"]
    for name, scen in data["scenarios"].items():
        w = scen["workload"]
        assert (
            w["rate_req_s"] > 0 and w["capacity_req_s_prefix_aware_ideal"] >= w["capacity_req_s_no_reuse"] > 0
        )
        assert list(scen["policies"]) == policies
        for policy, run in scen["policies"].items():
            assert "error" not in run, (name, policy, run.get("error"))
            s = run["summary"]
            assert s["completed"] == s["requests"] == w["requests"] and s["failed"] == 0, (
                name,
                policy,
                s["errors"],
            )
            assert s["output_tokens_exact"] is True
            assert sum(s["requests_per_replica"].values()) == s["completed"]
            assert set(s["requests_per_replica"]) == {"sim-0", "sim-1"}
            assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and s["request_throughput"] > 0
            assert 0 <= s["cache_hit_rate"] < 1
            if policy in peer:  # the router forwarded every request; the replicas' own counts add up
                assert run["router"]["counters"]["requests"] == s["requests"]
                assert sum(run["router"]["counters"]["per_worker"].values()) == s["requests"]
                continue
            assert set(run["gateway"]) >= {
                "predicted_cached_tokens",
                "actual_cached_tokens",
                "redis_round_trips_request",
            }
            # The gateway's counters agree with what the client saw in each response's usage.
            assert run["gateway"]["actual_cached_tokens"] == s["cached_tokens"]
            table = [dict(zip(run["requests"]["fields"], row)) for row in run["requests"]["rows"]]
            assert len(table) == s["requests"]
            assert all(r["replica"] in ("sim-0", "sim-1") and r["prompt_tokens"] > 0 for r in table)
            assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in table)
        assert set(scen["comparison"]) == {"vs_round-robin", *(f"vs_{p}" for p in peer)}
    chats = data["scenarios"]["multi-turn"]["policies"]["prefix-aware"]["requests"]
    turns = {row[chats["fields"].index("turn")] for row in chats["rows"]}
    assert turns == {0, 1}  # --quick: 2 turns per chat
    peer_targets = {"peer_shared_prefix", "peer_multi_turn"} if peer else set()
    assert set(data["targets"]) == {"shared_prefix", *peer_targets}
    assert isinstance(data["targets"]["shared_prefix"]["met"], bool)
    if peer:  # judged under cache pressure; reported only for the multi-turn chats
        assert isinstance(data["targets"]["peer_shared_prefix"]["met"], bool)
        assert data["targets"]["peer_multi_turn"]["met"] is None


@pytest.mark.parametrize(
    ("load", "a_a", "client"), [("paced", False, "lean"), ("closed", False, "httpx"), ("paced", True, "lean")]
)
def test_gateway_overhead_quick_writes_stats(
    tmp_path: Path, demo_model, load: str, a_a: bool, client: str
) -> None:
    out = tmp_path / "overhead.json"
    cpus = sorted(os.sched_getaffinity(0))
    layout = "isolated" if len(cpus) >= 2 and load == "closed" else "shared"
    # the closed load runs vLLM's router as the third side where it is installed (issue 27's peer)
    peer = load == "closed" and vllm_router.version() is not None
    argv = ["--quick", "--load", load, "--model", str(demo_model(preset="tiny")), "--log-dir",
            str(tmp_path / "logs"), "--out", str(out), "--cpu-layout", layout, "--client", client,
            *(["--a-a"] if a_a else []), *(["--peer", "vllm-router"] if peer else [])]  # fmt: skip
    sides = ["direct", "gateway", *(["vllm-router"] if peer else [])]
    result = overhead.main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result, default=str))
    assert data["config"]["client"] == client
    w = data["workload"]
    assert w["load"] == load
    n = w["rounds"] * (
        w["requests_per_round"] if load == "paced" else w["concurrency"] * w["requests_per_client"]
    )
    for side in sides:
        s = data["stats"][side]
        assert s["requests"] == s["ok"] == n and s["errors"] == {}
        assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p99"]
        assert data["reference"][side]["ok"] == data["config"]["reference_requests"]
        # The replica logged every request (the gateway forwarded the client's X-Request-Id), and its own
        # time is a part of what the client saw: what is left outside it is positive and smaller.
        assert s["with_engine_timing"] == n
        assert 0 < s["ttft_outside_ms"]["p50"] < s["ttft_ms"]["p50"]
        assert 0 < s["e2e_outside_ms"]["p50"] < s["e2e_ms"]["p50"]
    assert data["engine_timings_missing"] == 0
    if not a_a:  # the gateway logged every request with its own request path, a part of what the client saw
        assert data["gateway_timings_missing"] == 0 and data["gateway_request_path_ms"]["n"] == n
        assert data["reference_request_path_ms"]["n"] == data["config"]["reference_requests"]
        gateway_rows = [dict(zip(data["requests"]["fields"], row)) for row in data["requests"]["rows"]]
        assert all(0 < r["gateway_overhead_ms"] < r["gateway_ttft_ms"] < r["ttft_ms"]
                   for r in gateway_rows if r["side"] == "gateway")  # fmt: skip
    table = [dict(zip(data["requests"]["fields"], row)) for row in data["requests"]["rows"]]
    assert len(table) == len(sides) * n and all(r["engine_ttft_ms"] < r["ttft_ms"] for r in table)
    assert data["config"]["reference_requests"] == (0 if load == "paced" else 4)
    if load == "paced":  # every request of a round was timed, with the streams in flight measured
        assert all(r["streams_in_flight"]["peak"] >= 1 for r in data["rounds"])
        assert w["arrival_rate_per_s"] == pytest.approx(8 / ((8 + 0.5) * 0.005), rel=1e-3)
    measures = {"ttft_ms", "e2e_ms", "ttft_outside_ms", "e2e_outside_ms"}
    assert set(data["stats"]["added_ms"]) == set(data["stats"]["paired_ms"]) == measures
    assert all(data["stats"]["paired_ms"][m]["n"] == n for m in measures)
    assert len(data["round_pair_added_ms"]) == data["workload"]["rounds"]
    assert all(set(d) == {"round", *measures} for d in data["round_pair_added_ms"])
    per = data["per_gateway_request"]
    assert per["requests"] == n
    if a_a:  # both sides went to the replica: the gateway saw no request, and there is no verdict
        assert per["gateway_redis_round_trips"]["request_path"] == 0 and data["targets"] == {}
        return
    # Every gateway request makes its admission round trip on the request path.
    assert per["gateway_redis_round_trips"]["by_op"]["admit"] == pytest.approx(1.0)
    assert per["gateway_redis_round_trips"]["request_path"] >= 1.0
    assert per["redis_commands"]["total"] > 0 and per["cpu_ms"]["gateway"] > 0
    assert data["per_direct_request"]["cpu_ms"]["engine"] > 0
    assert [r["side"] for r in data["rounds"]] == sides
    assert set(data["targets"]) == {"added_latency", "added_latency_end_to_end", "redis_round_trips"}
    assert all(isinstance(t["met"], bool) for t in data["targets"].values())
    if layout == "isolated":  # the gateway and Redis got the second half of the CPUs, the rest the first half
        half = len(cpus) // 2
        assert data["cpu_layout"] == {"layout": "isolated", "gateway_and_redis": cpus[half:],
                                      "clients_and_replica": cpus[:half],
                                      **({"peer_router": cpus[half:]} if peer else {})}  # fmt: skip
    if peer:
        _check_peer_side(data, n)
    assert os.sched_getaffinity(0) == set(cpus)  # the test process got its CPUs back


def _check_peer_side(data: dict, n: int) -> None:
    """The peer router's side of a ``--peer vllm-router`` run (closed load): it served every request (the
    router's own count: warm-up, sequential reference and rounds; the replica logged each of the rounds' under
    the bench's request id, checked with the other sides: the router forwards ``X-Request-Id``), and the
    comparison and both targets are in the JSON."""
    w, cfg, peer = data["workload"], data["config"], data["peer"]
    assert peer["name"] == "vllm-router" and peer["version"] == vllm_router.version()
    assert peer["policy"] == "round_robin" and "prefix-aware routing" in peer["kvfleet_features"]
    assert cfg["quotas"] is True and w["tenant_limits"]["max_concurrent"] > 0  # every kvfleet feature on
    assert peer["router_counters"]["requests"] == cfg["warmup_requests"] + cfg["reference_requests"] + n
    assert data["reference"]["vllm-router"]["ok"] == cfg["reference_requests"]
    assert set(data["stats"]["added_ms_by_side"]) == {"gateway", "vllm-router"}
    assert data["stats"]["added_ms_by_side"]["gateway"] == data["stats"]["added_ms"]
    assert "peer" in data["per_side_request"]["vllm-router"]["cpu_ms"]  # its CPU seconds were read
    c = peer["comparison"]
    assert all(
        v > 0 for side in ("direct", "gateway", "vllm-router") for v in c["requests_per_s"][side]["per_round"]
    )
    assert set(peer["targets"]) == {"peer_added_ttft", "peer_throughput"}
    assert all(isinstance(t["met"], bool) for t in peer["targets"].values())
    assert peer["targets"]["peer_throughput"]["streams"] == w["concurrency"]
    assert len(peer["round_pair_added_ms"]) == w["rounds"]


def _event(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


@pytest.mark.parametrize("cut", [1, 7, 10_000])
def test_sse_client_reads_events_cut_anywhere(cut: int) -> None:
    """The bench's lean client: the events' text, usage and first-text time, whatever the TCP pieces."""
    body = b"".join([
        _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        _event({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        _event({"choices": [{"index": 0, "delta": {"content": "lo é"}}]}),
        _event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 4}}}),
        _event("[DONE]"),
    ])  # fmt: skip
    pieces = [body[i : i + cut] for i in range(0, len(body), cut)]

    async def go() -> fleet_client.StreamResult:
        async with (
            SseServer(pieces, gap_s=0.01, path="") as url,
            fleet_client.SseClient(url, "k", 10) as client,
        ):
            return await fleet_client.stream_request(client, "/v1/chat/completions", {"stream": True})

    r = asyncio.run(go())
    assert r.ok and r.error is None, r.error
    assert r.text == "Hello é" and (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (5, 2, 4)
    assert 0 < r.ttft <= r.e2e


def test_sse_client_reports_errors_without_raising() -> None:
    async def go(pieces: list[bytes], status: int = 200) -> fleet_client.StreamResult:
        server = SseServer(pieces, gap_s=0.01, status=status, path="")
        async with server as url, fleet_client.SseClient(url, None, 10) as client:
            return await client.stream("/v1/completions", {})

    r = asyncio.run(go([b'{"error": {"message": "slow down"}}'], status=429))
    assert not r.ok and r.status == 429 and "slow down" in r.error
    r = asyncio.run(go([_event({"error": {"message": "replica died"}}), _event("[DONE]")]))
    assert not r.ok and "replica died" in r.error
    r = asyncio.run(go([b"data: {not json\n\n"]))
    assert not r.ok and "JSONDecodeError" in r.error
    r = asyncio.run(go([_event("[1, 2]"), _event("[DONE]")]))  # JSON, but not an object
    assert not r.ok and "AttributeError" in r.error
    r = asyncio.run(go([_event({"choices": [{"index": 0, "delta": {"content": "x"}}]}), _event("[DONE]")]))
    assert not r.ok and r.error == "no usage in the stream"

    async def refused() -> fleet_client.StreamResult:
        async with fleet_client.SseClient("http://127.0.0.1:1", None, 10) as client:
            return await client.stream("/v1/completions", {})

    r = asyncio.run(refused())
    assert not r.ok and "UpstreamConnectError" in r.error


def test_paced_arrivals_hold_the_concurrency_asked_for() -> None:
    args = overhead.parse_args(["--concurrency", "100", "--step-ms", "50", "--output-len", "64"])
    assert args.load == "paced" and args.reference_requests == 0
    rate = overhead_load.paced_rate(args)
    assert rate == pytest.approx(100 / (64.5 * 0.05))  # Little's law: in flight = rate x stream duration
    arrivals = overhead_load.arrival_times(20_000, rate, seed=3)
    assert arrivals == sorted(arrivals) and arrivals == overhead_load.arrival_times(20_000, rate, seed=3)
    assert len(arrivals) / arrivals[-1] == pytest.approx(rate, rel=0.03)  # Poisson at that rate
    closed = overhead.parse_args(["--load", "closed"])
    assert (closed.output_len, closed.reference_requests, closed.requests_per_client) == (16, 50, 5)


def test_streams_in_flight_mean_and_peak() -> None:
    # [0,2] [1,3] [1.5,2.5] [4,5]: three open at 1.5-2; 6 s of streams in a 5 s round
    spans = [(0.0, 2.0), (1.0, 3.0), (1.5, 2.5), (4.0, 5.0)]
    assert overhead_load.in_flight(spans, 5.0) == {"mean": 1.2, "peak": 3}
    back_to_back = [(0.0, 1.0), (1.0, 2.0)]  # an end sorts before a start at the same time
    assert overhead_load.in_flight(back_to_back, 2.0)["peak"] == 1
    assert overhead_load.in_flight([], 1.0) == {"mean": 0.0, "peak": 0}


def test_added_latency_is_met_only_when_every_round_pair_agrees() -> None:
    rounds = [{"round": k, "side": side, "ttft_ms": {"p50": p50, "p99": p99}}
              for k, (d, g) in enumerate([((500.0, 800.0), (498.0, 790.0)), ((480.0, 700.0), (540.0, None))])
              for side, (p50, p99) in (("direct", d), ("gateway", g))]  # fmt: skip
    pairs = overhead_stats.pair_differences(rounds)
    assert pairs == [
        {"round": 0, "ttft_ms": {"p50": -2.0, "p99": -10.0}},
        {"round": 1, "ttft_ms": {"p50": 60.0, "p99": None}},
    ]
    pooled = lambda p50, p99: {m: {"p50": p50, "p99": p99} for m in ("ttft_ms", "e2e_ms")}  # noqa: E731
    # pooled under the limits, but the second pair added 60 ms: the run shows nothing either way
    verdict = lambda added, pairs: {  # noqa: E731
        k: v
        for k, v in overhead_report.added_latency_verdict(added, pairs, "ttft_ms", "e2e_ms").items()
        if k != "detail"
    }
    assert verdict(pooled(1.0, 5.0), pairs) == {"met": False, "inconclusive": True}
    assert verdict(pooled(1.0, 5.0), pairs[:1]) == {"met": True, "inconclusive": False}
    assert verdict(pooled(30.0, 5.0), pairs[:1]) == {"met": False, "inconclusive": False}
    assert verdict(pooled(1.0, None), pairs[:1]) == {"met": False, "inconclusive": False}  # no p99: not met


# ---- pure helpers ----------------------------------------------------------------------------------------


def _args(**kw):
    return routing.parse_args(
        ["--quick", *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    )


@pytest.mark.parametrize("scenario", routing_workloads.SCENARIOS)
def test_workloads_have_the_shape_asked_for(scenario: str, tokenizer_and_words) -> None:
    tok, words = tokenizer_and_words
    args = _args(groups=3, users_per_group=2, chats=2, turns=3, hot_requests=5, unique_requests=4)
    w = routing_workloads.build_workload(scenario, args, tok, words)
    again = routing_workloads.build_workload(scenario, args, tok, words)
    assert [(s.system, s.messages) for s in w.sessions] == [(s.system, s.messages) for s in again.sessions]
    for s in w.sessions:
        assert len(tok.encode(s.system, add_special_tokens=False)) == (
            args.chat_system_len if scenario == "multi-turn" else args.system_len
        )
    systems = {s.system for s in w.sessions}
    if scenario in ("shared-prefix", routing_workloads.NO_PRESSURE):
        assert len(w.sessions) == 6 and len(systems) == 3
        assert sorted(s.group for s in w.sessions) == [0, 0, 1, 1, 2, 2]
    elif scenario == "hot-prefix":
        assert len(w.sessions) == 5 and len(systems) == 1
    elif scenario == "no-sharing":
        assert len(w.sessions) == 4 and len(systems) == 4
    else:
        assert len(w.sessions) == 2 and all(len(s.messages) == 3 and len(s.think_s) == 2 for s in w.sessions)
    assert w.info["requests"] == sum(len(s.messages) for s in w.sessions)
    assert w.info["uncached_tokens_mean_ideal"] <= w.info["prompt_tokens_mean"]
    if scenario == "no-sharing":
        assert w.info["uncached_tokens_mean_ideal"] == w.info["prompt_tokens_mean"]
    else:
        assert w.info["uncached_tokens_mean_ideal"] < w.info["prompt_tokens_mean"]


def test_reuse_profile_counts_blocks_computed_once() -> None:
    a = list(range(40))  # 2 full blocks + 8 tokens
    b = [*range(32), 99, 98]  # shares a's 2 full blocks
    p = routing_workloads.reuse_profile([a, b, a], block_size=16)
    # a: 40 uncached; b: 34 - 32; a again: 40 - 32 (its partial last block was never cached)
    assert p == {
        "requests": 3,
        "prompt_tokens_mean": (40 + 34 + 40) / 3,
        "uncached_tokens_mean_ideal": (40 + 2 + 8) / 3,
    }
    # A hit never covers the last prompt token: a prompt of exactly 2 blocks seen twice recomputes its last block.
    c = list(range(32))
    assert (
        routing_workloads.reuse_profile([c, c], block_size=16)["uncached_tokens_mean_ideal"] == (32 + 16) / 2
    )


def test_calibrate_rate_is_a_fraction_of_capacity_and_capped(tokenizer_and_words) -> None:
    tok, words = tokenizer_and_words
    cost = fleet.SimCost(1000.0, 10.0, 0.0, 0.0)  # 1,000 prompt tokens/s per replica
    args = _args(replicas=2, max_rate=1000)
    w = routing_workloads.build_workload("shared-prefix", args, tok, words)
    c = routing_workloads.calibrate(w, args, cost)
    assert c["capacity_req_s_no_reuse"] == pytest.approx(2 * 1000 / w.info["prompt_tokens_mean"])
    assert c["capacity_req_s_prefix_aware_ideal"] == pytest.approx(
        2 * 1000 / w.info["uncached_tokens_mean_ideal"]
    )
    assert (
        c["rate_req_s"] == pytest.approx(0.8 * c["capacity_req_s_prefix_aware_ideal"])
        and not c["rate_capped"]
    )
    starts = [s.start for s in w.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    capped = routing_workloads.calibrate(w, _args(replicas=2, max_rate=0.5), cost)
    assert capped["rate_req_s"] == 0.5 and capped["rate_capped"]
    basis = routing_workloads.calibrate(w, _args(replicas=2, max_rate=1000, rate_basis="no-cache"), cost)
    assert basis["rate_req_s"] == pytest.approx(0.8 * basis["capacity_req_s_no_reuse"])
    chats = routing_workloads.build_workload("multi-turn", args, tok, words)
    cc = routing_workloads.calibrate(chats, args, cost)
    assert cc["session_rate_per_s"] == pytest.approx(cc["rate_req_s"] / args.turns)


def _record(replica: str, ttft: float, cached: int = 0, ok: bool = True, predicted: int | None = 0):
    return routing_requests.Record(0, 0, None, 0.0, ok, ttft if ok else None, ttft + 1 if ok else None, replica, 100, cached,
                          predicted, 8 if ok else None, None if ok else "HTTP 503: x")  # fmt: skip


def test_summary_compare_and_targets() -> None:
    recs = [_record("sim-0", 0.1, 50, predicted=50), _record("sim-0", 0.3, 0, predicted=16),
            _record("sim-1", 0.2), _record("sim-1", 0.0, ok=False)]  # fmt: skip
    s = routing_stats.summarize(recs, makespan=2.0, replicas=2, output_len=8)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["requests_per_replica"] == {"sim-0": 2, "sim-1": 1}
    assert s["load_share_max_over_mean"] == pytest.approx(2 / 1.5)
    assert s["request_throughput"] == 1.5 and s["output_tok_s"] == 12.0 and s["output_tokens_exact"] is True
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["cache_hit_rate"] == pytest.approx(50 / 300)
    assert (
        s["prediction_exact_fraction"] == pytest.approx(2 / 3)
        and s["prediction_mean_abs_error_tokens"] == 16 / 3
    )

    def run(ttft_ms: float, tput: float, share: float = 1.0):
        return {
            "summary": {
                "ttft_ms": {"mean": ttft_ms},
                "request_throughput": tput,
                "load_share_max_over_mean": share,
            }
        }

    comp = routing_stats.compare(
        {"prefix-aware": run(100, 4.0), "round-robin": run(400, 2.0), "least-load": run(96, 4.1)}
    )
    assert comp["vs_round-robin"] == {"ttft_mean_ratio": 4.0, "throughput_ratio": 2.0}
    t = routing_stats.targets({
        "shared-prefix": {"comparison": comp},
        "hot-prefix": {"policies": {"prefix-aware": run(1, 1, share=1.6)}},
        "no-sharing": {"comparison": comp},
    })  # fmt: skip
    assert t["shared_prefix"]["met"] is True
    assert t["hot_prefix"]["met"] is False
    assert t["no_sharing"]["met"] is True  # TTFT 4.2 % higher, throughput 2.4 % lower: within 5 %
    slow = routing_stats.compare({"prefix-aware": run(110, 4.0), "least-load": run(100, 4.0)})
    assert routing_stats.targets({"no-sharing": {"comparison": slow}})["no_sharing"]["met"] is False


def test_overhead_statistics() -> None:
    S = overhead_load.Sample
    # The replica's own TTFT of client c's request lands c steps of 50 ms late (its step clock); the
    # gateway's requests spend 2 ms more outside it.
    samples = [S("direct", 0, c, 0, True, 0.010 + 0.05 * c, 0.020 + 0.05 * c, None, 0.0, 0.008 + 0.05 * c,
                 0.017 + 0.05 * c) for c in range(5)]  # fmt: skip
    samples += [S("gateway", 0, c, 0, True, 0.012 + 0.05 * c, 0.025 + 0.05 * c, None, 0.0, 0.008 + 0.05 * c,
                  0.017 + 0.05 * c) for c in range(5)]  # fmt: skip
    samples.append(S("gateway", 0, 9, 0, False, None, None, "HTTP 503: x"))
    st = overhead_stats.side_stats(samples)
    assert (
        st["direct"]["ok"] == 5
        and st["gateway"]["requests"] == 6
        and st["gateway"]["errors"] == {"HTTP 503: x": 1}
    )
    assert st["gateway"]["with_engine_timing"] == 5
    assert st["direct"]["ttft_ms"]["p50"] == pytest.approx(110.0)
    assert st["direct"]["ttft_outside_ms"] == {"n": 5, "mean": pytest.approx(2.0), "p50": pytest.approx(2.0),
                                              "p90": pytest.approx(2.0), "p99": pytest.approx(2.0),
                                              "max": pytest.approx(2.0)}  # fmt: skip
    assert st["added_ms"]["ttft_ms"]["p50"] == pytest.approx(2.0)
    assert st["added_ms"]["e2e_ms"]["p99"] == pytest.approx(5.0)
    assert st["added_ms"]["ttft_outside_ms"]["p99"] == pytest.approx(2.0)
    assert st["added_ms"]["e2e_outside_ms"]["p50"] == pytest.approx(5.0)
    assert st["paired_ms"]["ttft_ms"] == {"n": 5, "p50": pytest.approx(2.0), "p99": pytest.approx(2.0)}
    assert st["paired_ms"]["e2e_outside_ms"]["n"] == 5


def test_overhead_rounds_hold_the_load_generators_collections() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with overhead_load.collections_between_rounds():
        assert not gc.isenabled() and gc.get_freeze_count() > frozen
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0 if frozen == 0 else gc.get_freeze_count() >= frozen
    with pytest.raises(RuntimeError), overhead_load.collections_between_rounds():
        raise RuntimeError("a round failed")
    assert gc.isenabled()  # whatever happened in the round


def test_overhead_engine_timings_from_the_replica_log(tmp_path: Path) -> None:
    log = tmp_path / "replica.log"
    log.write_text(
        "2026-11-25 08:00:00,001 INFO kvfleet_engine.server.serving: chat gwo-gateway-0-3-0 model=sim status=200"
        " prompt=21 cached=0 completion=64 ttft=52.4ms e2e=3201.5ms\n"
        "2026-11-25 08:00:00,002 INFO kvfleet_engine.server.serving: chat gwo-direct-0-3-0 model=sim status=499"
        " prompt=21 cached=0 completion=3 ttft=40.0ms e2e=90.0ms\n"
        "2026-11-25 08:00:00,003 INFO kvfleet_engine.server.serving: chat chatcmpl-x model=sim status=200"
        " prompt=21 cached=0 completion=64 ttft=52.4ms e2e=3201.5ms\n"
    )  # a disconnected request (499) and one the bench did not send are not its samples' timings
    assert overhead_logs.engine_timings(log) == {
        "gwo-gateway-0-3-0": (pytest.approx(0.0524), pytest.approx(3.2015))
    }
    samples = [overhead_load.Sample("gateway", 0, 3, 0, True, 0.06, 3.3, None),
               overhead_load.Sample("direct", 0, 3, 0, True, 0.06, 3.3, None)]  # fmt: skip
    assert overhead_logs.attach_engine_timings(samples, log, wait_s=0.0) == 1
    assert samples[0].engine_ttft == pytest.approx(0.0524) and samples[1].engine_ttft is None


def test_overhead_gateway_timings_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    log.write_text(
        "2026-11-25 10:38:19,949 INFO kvfleet_gateway.requests: gwo-gateway-0-1-0 tenant=bench model=sim chat"
        " status=200 replica=sim-0#17 policy=prefix-aware prompt=21 cached(pred/actual)=0/0 completion=8"
        " attempts=1 overhead=1.62ms ttft=51.7ms 406.9ms\n"
        "2026-11-25 10:38:19,950 INFO kvfleet_gateway.requests: gwo-gateway-0-2-0 tenant=bench model=sim chat"
        " status=503 replica=- policy=- prompt=21 cached(pred/actual)=0/- completion=None attempts=0"
        " overhead=- ttft=- 0.9ms\n"
    )  # a request that never reached a replica has no timings
    assert overhead_logs.gateway_timings(log) == {
        "gwo-gateway-0-1-0": (pytest.approx(0.00162), pytest.approx(0.0517))
    }
    samples = [overhead_load.Sample("gateway", 0, c, 0, True, 0.06, 3.3, None) for c in (1, 2)]
    assert overhead_logs.attach_gateway_timings(samples, log, wait_s=0.0) == 1
    assert samples[0].gateway_overhead == pytest.approx(0.00162) and samples[1].gateway_overhead is None


def test_overhead_verdict_reads_the_measure_asked_for() -> None:
    added = {"ttft_outside_ms": {"p50": 1.2, "p99": 0.8}, "e2e_outside_ms": {"p50": -0.8, "p99": 6.0},
             "ttft_ms": {"p50": 1.6, "p99": 25.0}, "e2e_ms": {"p50": 0.3, "p99": -18.0}}  # fmt: skip
    pairs = [{"round": 0, "ttft_outside_ms": {"p50": 1.1, "p99": 3.0}, "ttft_ms": {"p50": 1.8, "p99": 30.0}},
             {"round": 1, "ttft_outside_ms": {"p50": 1.4, "p99": -2.0}, "ttft_ms": {"p50": 1.2, "p99": 9.0}}]  # fmt: skip
    v = overhead_report.added_latency_verdict(added, pairs, "ttft_outside_ms", "e2e_outside_ms")
    assert v["met"] is True and v["inconclusive"] is False
    assert "+1.1 / +3.0, +1.4 / -2.0" in v["detail"]
    e2e = overhead_report.added_latency_verdict(added, pairs, "ttft_ms", "e2e_ms")
    assert e2e["met"] is False and e2e["inconclusive"] is False  # the pooled TTFT p99 is over the limit
    pairs[0]["ttft_outside_ms"]["p99"] = 12.0  # pooled under the limits, one pair over: the run shows nothing
    v = overhead_report.added_latency_verdict(added, pairs, "ttft_outside_ms", "e2e_outside_ms")
    assert v["met"] is False and v["inconclusive"] is True


def test_profile_summary() -> None:
    raw = "\n".join([
        "main (app.py:1);handle (kvfleet_gateway/proxy.py:10);encode (tokenizers/x.py:3) 6",
        "main (app.py:1);send (h11/_conn.py:5) 3",
        "main (app.py:1);start_span (opentelemetry/trace/__init__.py:9) 1",
    ])  # fmt: skip
    p = overhead_profile.summarize_profile(raw)
    assert p["samples"] == 10
    assert p["self"][0] == ["encode (tokenizers/x.py)", 0.6]
    inclusive = dict(p["inclusive"])
    assert inclusive["main (app.py)"] == 1.0 and inclusive["handle (kvfleet_gateway/proxy.py)"] == 0.6
    assert dict(p["library_self"]) == {"tokenizer (transformers)": 0.6, "h11": 0.3, "opentelemetry": 0.1}
    assert dict(p["library_inclusive"])["kvfleet_gateway"] == 0.6


def test_redis_command_stats_delta_excludes_its_own_info_calls() -> None:
    before = {"total_commands_processed": 100, "calls": {"evalsha": 10, "info": 4}}
    after = {"total_commands_processed": 112, "calls": {"evalsha": 20, "info": 6}}
    assert fleet_metrics.command_stats_delta(before, after) == {"total": 10, "calls": {"evalsha": 10}}
