"""vLLM's router as the gateway benchmarks' peer (issue 27): the pure parts (side order, the comparison and
targets of ``bench/gateway_overhead.py --peer`` and ``bench/routing.py``'s peer policies, the no-pressure
scenario's KV size, the router's command line). The end-to-end runs with the router are in
``test_gateway_bench.py`` (the closed load and the routing quick run include it when it is installed)."""

from __future__ import annotations

import pytest

from bench import _gateway_overhead_load as overhead_load
from bench import _gateway_overhead_peer as overhead_peer
from bench import _routing_stats as routing_stats
from bench import _routing_workloads as routing_workloads
from bench import _vllm_router as vllm_router
from bench import routing
from bench._routing_requests import Record


def test_routed_sides_take_turns_after_direct() -> None:
    sides = ["direct", "gateway", "vllm-router"]
    assert [overhead_load.side_order(sides, k) for k in range(3)] == [
        ["direct", "gateway", "vllm-router"],
        ["direct", "vllm-router", "gateway"],
        ["direct", "gateway", "vllm-router"],
    ]
    assert overhead_load.side_order(["direct", "gateway"], 1) == ["direct", "gateway"]  # as before the peer


def _overhead_result(load: str, seq_added: dict[str, float], walls: dict[str, float]) -> dict:
    """The parts of a ``--peer`` result the comparison reads: one round per side of 100 completed requests
    in ``walls[side]`` seconds, and the sequential reference's added TTFT p50 per routed side."""
    side_key = {"kvfleet": "gateway", "vllm_router": "vllm-router"}
    added = {
        side_key[k]: {"ttft_ms": {"p50": v}, "ttft_outside_ms": {"p50": v - 0.5}}
        for k, v in seq_added.items()
    }
    return {
        "workload": {"load": load, "concurrency": 64},
        "reference": {"added_ms_by_side": added, "paired_ms_by_side": added},
        "stats": {"added_ms_by_side": added},
        "rounds": [{"round": 0, "side": side, "ok": 100, "wall_s": wall} for side, wall in walls.items()],
        "per_side_request": {
            "gateway": {"cpu_ms": {"gateway": 2.5}},
            "vllm-router": {"cpu_ms": {"peer": 0.6}},
        },
    }


def test_peer_comparison_and_targets() -> None:
    result = _overhead_result(
        "closed", {"kvfleet": 2.0, "vllm_router": 2.5}, {"direct": 1.0, "gateway": 2.0, "vllm-router": 2.5}
    )
    c = overhead_peer.compare(result)
    assert c["requests_per_s"]["gateway"] == {"pooled": 50.0, "per_round": [50.0]}
    assert c["requests_per_s_ratio_per_round"] == [pytest.approx(1.25)]
    assert c["cpu_ms_per_request"] == {"kvfleet_gateway": 2.5, "vllm_router": 0.6}
    assert c["sequential_added_ttft_outside_p50_ms"] == {"kvfleet": 1.5, "vllm_router": 2.0}
    result["peer"] = {"comparison": c}
    t = overhead_peer.targets(result)
    assert t["peer_added_ttft"]["met"] is True and t["peer_added_ttft"]["ratio"] == pytest.approx(0.8)
    assert t["peer_throughput"]["met"] is True and t["peer_throughput"]["ratio"] == pytest.approx(1.25)
    assert t["peer_throughput"]["streams"] == 64 and "target names" not in t["peer_throughput"]["detail"]

    # kvfleet slower on both: FAIL on both
    slow = _overhead_result(
        "closed", {"kvfleet": 3.0, "vllm_router": 2.5}, {"direct": 1.0, "gateway": 3.0, "vllm-router": 2.5}
    )
    slow["peer"] = {"comparison": overhead_peer.compare(slow)}
    assert {k: v["met"] for k, v in overhead_peer.targets(slow).items()} == {
        "peer_added_ttft": False,
        "peer_throughput": False,
    }


def test_peer_targets_with_noise_and_under_the_paced_load() -> None:
    # the router's added TTFT at or below zero (noise): no ratio; kvfleet's must be no larger to pass
    noisy = _overhead_result(
        "paced", {"kvfleet": 0.4, "vllm_router": -0.2}, {"direct": 1, "gateway": 1, "vllm-router": 1}
    )
    noisy["peer"] = {"comparison": overhead_peer.compare(noisy)}
    t = overhead_peer.targets(noisy)
    assert t["peer_added_ttft"]["met"] is False and t["peer_added_ttft"]["ratio"] is None
    assert "no ratio" in t["peer_added_ttft"]["detail"]
    assert "peer_throughput" not in t  # paced: every side's rate is the arrival rate


def test_routing_peer_targets() -> None:
    def run(ttft_ms: float, tput: float, share: float = 1.0) -> dict:
        return {"summary": {"ttft_ms": {"mean": ttft_ms}, "request_throughput": tput,
                            "load_share_max_over_mean": share}}  # fmt: skip

    pressure = {"prefix-aware": run(100, 3.0), "vllm-router:cache_aware": run(250, 2.4)}
    roomy = {"prefix-aware": run(100, 3.0), "vllm-router:cache_aware": run(120, 3.0)}
    hot = {"prefix-aware": run(1, 1, 1.2), "vllm-router:cache_aware": run(1, 1, 4.0),
           "vllm-router:round_robin": run(1, 1, 1.0)}  # fmt: skip
    scenarios = {
        "shared-prefix": {"comparison": routing_stats.compare(pressure)},
        "shared-prefix-no-pressure": {"comparison": routing_stats.compare(roomy)},
        "hot-prefix": {"policies": hot},
    }
    t = routing_stats.targets(scenarios)
    p = t["peer_shared_prefix"]
    assert p["ttft_mean_kvfleet_over_router"] == pytest.approx(0.4)
    assert p["throughput_kvfleet_over_router"] == pytest.approx(1.25) and p["met"] is True
    assert t["peer_shared_prefix_no_pressure"]["met"] is None  # reported, not judged
    assert t["peer_shared_prefix_no_pressure"]["ttft_mean_kvfleet_over_router"] == pytest.approx(100 / 120)
    assert t["peer_hot_prefix"]["load_share_max_over_mean"] == {
        "prefix-aware": 1.2,
        "vllm-router:cache_aware": 4.0,
        "vllm-router:round_robin": 1.0,
    }
    assert t["hot_prefix"]["met"] is True
    # TTFT only 0.6x the router's: not enough
    near = {"prefix-aware": run(150, 3.0), "vllm-router:cache_aware": run(250, 2.4)}
    assert (
        routing_stats.targets({"shared-prefix": {"comparison": routing_stats.compare(near)}})[
            "peer_shared_prefix"
        ]["met"]
        is False
    )


def test_router_load_per_replica_comes_from_the_replicas() -> None:
    recs = [Record(i, 0, None, 0.0, True, 0.1, 0.2, None, 100, 0, None, 8, None) for i in range(4)]
    s = routing_stats.summarize(recs, 2.0, 2, 8, served={"sim-0": 3, "sim-1": 1})
    assert s["requests_per_replica"] == {"sim-0": 3, "sim-1": 1}
    assert s["load_share_max_over_mean"] == pytest.approx(1.5)
    assert s["predicted_cached_tokens_of"] == 0  # the router predicts nothing


def test_no_pressure_scenario_is_shared_prefix_with_room() -> None:
    args = routing.parse_args(["--quick", "--groups", "3", "--system-len", "500", "--num-kv-blocks", "64"])
    assert routing_workloads.kv_blocks("shared-prefix", args) == 64
    per_group = -(-(500 + args.question_len + args.output_len) // 16)
    assert routing_workloads.kv_blocks(routing_workloads.NO_PRESSURE, args) == 2 * 3 * per_group
    big = routing.parse_args(["--quick", "--num-kv-blocks", "100000"])
    assert routing_workloads.kv_blocks(routing_workloads.NO_PRESSURE, big) == 100000  # never smaller


def test_router_counters_delta() -> None:
    before = {
        "requests": 5.0,
        "per_worker": {"http://a": 3.0, "http://b": 2.0},
        "prefix_decisions": {"prefix_hit": 1.0},
    }
    after = {"requests": 9.0, "per_worker": {"http://a": 3.0, "http://b": 6.0},
             "prefix_decisions": {"prefix_hit": 4.0, "prefix_miss": 1.0}}  # fmt: skip
    assert vllm_router.counters_delta(before, after) == {
        "requests": 4.0,
        "per_worker": {"http://b": 4.0},
        "prefix_decisions": {"prefix_hit": 3.0, "prefix_miss": 1.0},
        "routing_inputs": {},
    }


@pytest.mark.skipif(vllm_router.version() is None, reason="vllm-router is not installed")
def test_router_command_line() -> None:
    cmd, metrics_port = vllm_router.router_command(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"], "round_robin"
    )
    argv = cmd.argv
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    port = int(argv[argv.index("--port") + 1])
    assert cmd.base_url == f"http://127.0.0.1:{port}" and metrics_port != port  # not its fixed default 29000
    assert int(argv[argv.index("--prometheus-port") + 1]) == metrics_port
    with pytest.raises(ValueError, match="unknown vllm-router policy"):
        vllm_router.router_command(["http://127.0.0.1:1"], "prefix-aware")
