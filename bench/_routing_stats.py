"""What a routing run's records add up to (``bench/routing.py``): latency, throughput, load share and cache
figures per run, prefix-aware against the other policies (vLLM's router among them), and the issues'
targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench import _serve_common as sc
from bench._routing_requests import Record

TARGET_TTFT_RATIO = 3.0  # (a) round-robin mean TTFT / prefix-aware mean TTFT
TARGET_THROUGHPUT_RATIO = 1.3  # (a) prefix-aware / round-robin completed requests per second
TARGET_MAX_LOAD_SHARE = 1.5  # (c) max replica requests / mean
TARGET_NO_SHARING_TOLERANCE = 0.05  # (d) prefix-aware vs least-load
# issue 27, (a) under cache pressure: kvfleet prefix-aware against vllm-router cache_aware
PEER = "vllm-router:cache_aware"
PEER_POLICIES = ("vllm-router:cache_aware", "vllm-router:round_robin")
TARGET_PEER_TTFT_RATIO = 0.5  # prefix-aware mean TTFT / the router's, at most
TARGET_PEER_THROUGHPUT_RATIO = 1.2  # prefix-aware completed requests/s / the router's, at least


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def summarize(
    records: Sequence[Record],
    makespan: float,
    replicas: int,
    output_len: int,
    served: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Latency, throughput, load share and cache figures of one run. Latencies in milliseconds. The load per
    replica comes from each record's replica (the gateway names it), or from ``served`` (replica -> requests
    it completed, its own counter) where the router in front names none."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    per_replica: dict[str, int] = {f"sim-{i}": 0 for i in range(replicas)}
    if served is not None:
        per_replica.update(served)
    else:
        for r in ok:
            if r.replica is not None:
                per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    mean_load = len(ok) / replicas if replicas else 0.0
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    predicted = [r for r in ok if r.predicted_cached is not None and r.cached_tokens is not None]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[(r.error or "?")[:120]] = errors.get((r.error or "?")[:120], 0) + 1
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "makespan_s": round(makespan, 3),
        "request_throughput": len(ok) / makespan if makespan > 0 else None,
        "output_tok_s": out_tokens / makespan if makespan > 0 else None,
        "output_tokens_exact": bool(ok) and all(r.output_tokens == output_len for r in ok),
        "ttft_ms": {
            "mean": _ms(sum(ttft) / len(ttft)) if ttft else None,
            "p50": _ms(sc.percentile(ttft, 50)),
            "p90": _ms(sc.percentile(ttft, 90)),
            "p99": _ms(sc.percentile(ttft, 99)),
            "max": _ms(max(ttft)) if ttft else None,
        },
        "e2e_ms": {
            "mean": _ms(sum(e2e) / len(e2e)) if e2e else None,
            "p50": _ms(sc.percentile(e2e, 50)),
            "p99": _ms(sc.percentile(e2e, 99)),
        },
        "requests_per_replica": per_replica,
        "load_share_max_over_mean": (max(per_replica.values()) / mean_load) if mean_load else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else None,
        "predicted_cached_tokens": sum(r.predicted_cached or 0 for r in predicted),
        "predicted_cached_tokens_of": len(predicted),
        "prediction_exact_fraction": (
            sum(r.predicted_cached == r.cached_tokens for r in predicted) / len(predicted)
            if predicted
            else None
        ),
        "prediction_mean_abs_error_tokens": (
            sum(abs((r.predicted_cached or 0) - (r.cached_tokens or 0)) for r in predicted) / len(predicted)
            if predicted
            else None
        ),
    }


def _get(run: dict[str, Any] | None, *keys: str) -> float | None:
    v: Any = run
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v if isinstance(v, int | float) else None


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prefix-aware against each other policy: TTFT (other / prefix-aware: > 1 means prefix-aware is faster)
    and throughput (prefix-aware / other)."""
    pa = runs.get("prefix-aware")
    out: dict[str, Any] = {}
    for other in ("round-robin", "least-load", *PEER_POLICIES):
        o = runs.get(other)
        if pa is None or o is None:
            continue
        t_pa, t_o = _get(pa, "summary", "ttft_ms", "mean"), _get(o, "summary", "ttft_ms", "mean")
        x_pa, x_o = _get(pa, "summary", "request_throughput"), _get(o, "summary", "request_throughput")
        out[f"vs_{other}"] = {
            "ttft_mean_ratio": t_o / t_pa if t_pa and t_o is not None else None,
            "throughput_ratio": x_pa / x_o if x_pa is not None and x_o else None,
        }
    return out


def targets(scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, evaluated where the run has what they need."""
    out: dict[str, Any] = {}
    a = scenarios.get("shared-prefix", {}).get("comparison", {}).get("vs_round-robin")
    if a and a["ttft_mean_ratio"] is not None and a["throughput_ratio"] is not None:
        out["shared_prefix"] = {
            "ttft_mean_ratio": a["ttft_mean_ratio"], "throughput_ratio": a["throughput_ratio"],
            "met": a["ttft_mean_ratio"] >= TARGET_TTFT_RATIO and a["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO,
        }  # fmt: skip
    c = _get(scenarios.get("hot-prefix", {}).get("policies", {}).get("prefix-aware"), "summary",
             "load_share_max_over_mean")  # fmt: skip
    if c is not None:
        out["hot_prefix"] = {"load_share_max_over_mean": c, "met": c <= TARGET_MAX_LOAD_SHARE}
    d = scenarios.get("no-sharing", {}).get("comparison", {}).get("vs_least-load")
    if d and d["ttft_mean_ratio"] is not None and d["throughput_ratio"] is not None:
        tol = TARGET_NO_SHARING_TOLERANCE
        # ttft_mean_ratio = least-load / prefix-aware: prefix-aware at most 5 % slower <=> ratio >= 1/1.05
        out["no_sharing"] = {
            "ttft_mean_pa_over_ll": 1.0 / d["ttft_mean_ratio"] if d["ttft_mean_ratio"] else None,
            "throughput_pa_over_ll": d["throughput_ratio"],
            "met": d["ttft_mean_ratio"] >= 1.0 / (1.0 + tol) and d["throughput_ratio"] >= 1.0 - tol,
        }
    return out | peer_targets(scenarios)


def peer_targets(scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 27: kvfleet prefix-aware against vllm-router cache_aware in (a) under cache pressure (the
    target), in (a) without pressure and in (b) (reported: ``met`` None), and the router's max/mean replica
    load in (c) beside kvfleet's (reported)."""
    out: dict[str, Any] = {}
    for scen, name, judged in (("shared-prefix", "peer_shared_prefix", True),
                               ("shared-prefix-no-pressure", "peer_shared_prefix_no_pressure", False),
                               ("multi-turn", "peer_multi_turn", False)):  # fmt: skip
        c = scenarios.get(scen, {}).get("comparison", {}).get(f"vs_{PEER}")
        if not c or c["ttft_mean_ratio"] is None or c["throughput_ratio"] is None:
            continue
        ttft = 1.0 / c["ttft_mean_ratio"] if c["ttft_mean_ratio"] else None
        met = (ttft is not None and ttft <= TARGET_PEER_TTFT_RATIO
               and c["throughput_ratio"] >= TARGET_PEER_THROUGHPUT_RATIO)  # fmt: skip
        out[name] = {"ttft_mean_kvfleet_over_router": ttft, "throughput_kvfleet_over_router": c["throughput_ratio"],
                     "met": met if judged else None}  # fmt: skip
    hot = scenarios.get("hot-prefix", {}).get("policies", {})
    shares = {p: _get(run, "summary", "load_share_max_over_mean") for p, run in hot.items()}
    if any(shares.get(p) is not None for p in PEER_POLICIES):
        out["peer_hot_prefix"] = {"load_share_max_over_mean": shares, "met": None}
    return out
