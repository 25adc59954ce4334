"""The gateway overhead benchmark against its peer (``bench/gateway_overhead.py --peer vllm-router``): the
kvfleet gateway and vLLM's Rust router in front of the same replica, in the same run, and the issue's two
targets on the pair.

- Added TTFT p50 with sequential streams (the ``closed`` load's sequential reference: one request at a
  time, every side in turn with the same prompt): kvfleet's added / the router's added, at most 1.0. Added
  = the side's client TTFT p50 minus the direct side's. The target reads kvfleet's added <= the router's;
  the ratio is given only where both are > 0 (a figure <= 0 is noise: too few requests, or a busy machine).
- Requests per second at ``--concurrency`` closed-loop streams (the issue names 64): completed requests
  over the rounds' wall time per side, kvfleet / router, at least 1.0. Only the ``closed`` load saturates
  the machine; under ``paced`` the rate is the arrival rate for every side, so there is nothing to compare.

Both come with the per-round-set figures (how far single sets disagree on this machine) and the CPU each
router spent per request.
"""

from __future__ import annotations

from typing import Any

from bench._gateway_overhead_load import PEER_SIDE

TARGET_ADDED_TTFT_RATIO = 1.0  # kvfleet's added TTFT p50 / the router's, at most (sequential streams)
TARGET_THROUGHPUT_RATIO = 1.0  # kvfleet's requests/s / the router's, at least (closed load)
TARGET_STREAMS = 64  # the concurrency the throughput target names


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, where both are > 0 (added latencies at or below zero are noise, their ratios meaningless)."""
    return None if a is None or b is None or a <= 0 or b <= 0 else a / b


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def requests_per_s(rounds: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """Completed requests / wall seconds of ``side``'s rounds, pooled and per round."""
    mine = [r for r in rounds if r["side"] == side]
    wall = sum(r["wall_s"] for r in mine)
    return {"pooled": sum(r["ok"] for r in mine) / wall if wall > 0 else None,
            "per_round": [r["ok"] / r["wall_s"] if r["wall_s"] > 0 else None for r in mine]}  # fmt: skip


def compare(result: dict[str, Any]) -> dict[str, Any]:
    """kvfleet against the peer: added TTFT (sequential and in the rounds), requests/s, CPU per request."""
    ref = result["reference"].get("added_ms_by_side", {})
    rounds_added = result["stats"].get("added_ms_by_side", {})
    ref_paired = result["reference"].get("paired_ms_by_side", {})

    def added(by: dict[str, Any], side: str, measure: str) -> float | None:
        return by.get(side, {}).get(measure, {}).get("p50")

    tput = {side: requests_per_s(result["rounds"], side) for side in ("direct", "gateway", PEER_SIDE)}
    per_round = [_ratio(g, p) for g, p in zip(tput["gateway"]["per_round"], tput[PEER_SIDE]["per_round"])]
    cpu = {
        side: result["per_side_request"].get(side, {}).get("cpu_ms", {}) for side in ("gateway", PEER_SIDE)
    }
    return {
        "sequential_added_ttft_p50_ms": {"kvfleet": added(ref, "gateway", "ttft_ms"),
                                         "vllm_router": added(ref, PEER_SIDE, "ttft_ms")},
        "sequential_added_ttft_outside_p50_ms": {"kvfleet": added(ref, "gateway", "ttft_outside_ms"),
                                                 "vllm_router": added(ref, PEER_SIDE, "ttft_outside_ms")},
        "sequential_paired_ttft_p50_ms": {"kvfleet": added(ref_paired, "gateway", "ttft_ms"),
                                          "vllm_router": added(ref_paired, PEER_SIDE, "ttft_ms")},
        "rounds_added_ttft_p50_ms": {"kvfleet": added(rounds_added, "gateway", "ttft_ms"),
                                     "vllm_router": added(rounds_added, PEER_SIDE, "ttft_ms")},
        "requests_per_s": tput,
        "requests_per_s_ratio_per_round": per_round,
        "cpu_ms_per_request": {"kvfleet_gateway": cpu["gateway"].get("gateway"),
                               "vllm_router": cpu[PEER_SIDE].get("peer")},
    }  # fmt: skip


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's two targets on ``compare``'s figures (absent where the run cannot show one)."""
    c = result["peer"]["comparison"]
    w = result["workload"]
    out: dict[str, Any] = {}
    seq = c["sequential_added_ttft_p50_ms"]
    if seq["kvfleet"] is not None and seq["vllm_router"] is not None:
        ratio = _ratio(seq["kvfleet"], seq["vllm_router"])
        out["peer_added_ttft"] = {
            "met": seq["kvfleet"] <= TARGET_ADDED_TTFT_RATIO * seq["vllm_router"], "ratio": ratio,
            "detail": f"sequential streams, added TTFT p50 kvfleet {_f(seq['kvfleet'])} ms vs vllm-router "
                      f"{_f(seq['vllm_router'])} ms: "
                      + (f"{ratio:.2f}x" if ratio is not None else "no ratio (a figure <= 0)")
                      + f" (limit {TARGET_ADDED_TTFT_RATIO:g}x)",
        }  # fmt: skip
    if w["load"] == "closed":
        rps = c["requests_per_s"]
        ratio = _ratio(rps["gateway"]["pooled"], rps[PEER_SIDE]["pooled"])
        streams = w["concurrency"]
        out["peer_throughput"] = {
            "met": ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO, "ratio": ratio, "streams": streams,
            "detail": f"{streams} streams{'' if streams == TARGET_STREAMS else f' (the target names {TARGET_STREAMS})'}: "
                      f"kvfleet {_f(rps['gateway']['pooled'], 1)} vs vllm-router {_f(rps[PEER_SIDE]['pooled'], 1)} "
                      f"req/s (direct {_f(rps['direct']['pooled'], 1)}): {_f(ratio)}x (at least "
                      f"{TARGET_THROUGHPUT_RATIO:g}x); per round set "
                      + ", ".join(f"{_f(x)}x" for x in c["requests_per_s_ratio_per_round"]),
        }  # fmt: skip
    return out


def notes(result: dict[str, Any]) -> list[str]:
    """The printed lines of the peer comparison: what ran, the figures, PASS/FAIL per target."""
    p = result["peer"]
    c = p["comparison"]
    out = [f"peer: vllm-router {p['version']} --policy {p['policy']} in front of the same replica (no auth, "
           f"quotas or tenants); kvfleet with {p['kvfleet_features']}"]  # fmt: skip
    r = c["rounds_added_ttft_p50_ms"]
    out.append(
        f"added TTFT p50 in the rounds: kvfleet {_f(r['kvfleet'])} ms, vllm-router {_f(r['vllm_router'])} ms"
    )
    cpu = c["cpu_ms_per_request"]
    out.append(f"router CPU per request in the rounds: kvfleet gateway {_f(cpu['kvfleet_gateway'])} ms, "
               f"vllm-router {_f(cpu['vllm_router'])} ms")  # fmt: skip
    if not p["targets"]:
        out.append("peer targets: none evaluable in this run (sequential reference: --load closed; req/s: "
                   "--load closed)")  # fmt: skip
    for name, t in p["targets"].items():
        out.append(f"{'PASS' if t['met'] else 'FAIL'} {name}: {t['detail']}")
    return out
