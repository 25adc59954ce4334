"""``bench/autoscale.py`` on a short trace: the real autoscaling policy against fixed fleets, in virtual time.

The trace (20 minutes of virtual time, ~1 s of wall time) has one burst far above what a single replica
serves and an idle stretch longer than the shortened scale-to-zero delay. Assertions are about what the
simulation must show whatever its constants: the fleets' order in p99 TTFT and in cost, every request
served, scale to zero and back, the JSON's fields. No wall-clock assertion (the time is virtual)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import autoscale

SHORT = [
    "--duration-s", "1200", "--base-rps", "0.5", "--bursts", "200:120:25", "--idle", "600:400",
    "--max-replicas", "4", "--cold-start-s", "30", "--cold-start-sweep", "60", "--min-replicas-sweep", "",
    "--scale-down-delay-s", "60", "--scale-to-zero-after-s", "120",
]  # fmt: skip
REASONS = {"ColdStart", "ScaleUp", "ScaleDown", "ScaleToZero", "BelowMinimum", "AboveMaximum"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("autoscale") / "autoscale.json"
    result = autoscale.main([*SHORT, "--out", str(out)])
    return result, json.loads(out.read_text())


def test_json_has_the_fields(run: tuple[dict, dict]) -> None:
    result, data = run
    assert data == json.loads(json.dumps(result, default=str))
    assert data["benchmark"] == "autoscale" and data["virtual_time"] is True
    assert data["command"].startswith(".venv/bin/python -m bench.autoscale --duration-s 1200")
    assert list(data["scenarios"]) == ["fixed-1", "fixed-max", "autoscaled", "autoscaled, cold start 60 s"]
    trace = data["trace"]
    assert (
        trace["requests"] == sum(s["requests"] for s in trace["segments"]) == sum(trace["requests_per_5min"])
    )
    assert [s["rps"] for s in trace["segments"]] == [0.5, 12.5, 0.5, 0.0, 0.5]
    for s in data["scenarios"].values():
        assert set(s["ttft_s"]) == {"p50", "p90", "p99", "mean", "max"}
        assert s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"] <= s["ttft_s"]["max"]
        assert {"replica_seconds", "p99_vs_fixed_max", "cost_vs_fixed_max", "slower_than_target"} <= set(s)
    target = data["target"]
    auto = data["scenarios"]["autoscaled"]
    assert (
        target["p99_ratio"] == auto["p99_vs_fixed_max"] and target["cost_ratio"] == auto["cost_vs_fixed_max"]
    )
    assert target["met"] == (target["p99_ratio"] <= 1.3 and target["cost_ratio"] <= 0.6)


def test_every_request_completes_in_every_scenario(run: tuple[dict, dict]) -> None:
    _, data = run
    n = data["trace"]["requests"]
    assert n > 500
    for name, s in data["scenarios"].items():
        assert s["requests"] == s["completed"] == n, name


def test_fleets_order_in_latency_and_cost(run: tuple[dict, dict]) -> None:
    _, data = run
    s = data["scenarios"]
    p99 = {name: v["ttft_s"]["p99"] for name, v in s.items()}
    assert p99["fixed-max"] == min(p99.values())
    assert p99["fixed-1"] == max(p99.values())
    assert p99["fixed-1"] > 2 * p99["fixed-max"]  # the burst overloads one replica
    assert s["fixed-1"]["queued_at_replica"] > 0 and s["fixed-max"]["queued_at_replica"] == 0
    # A fixed fleet pays for every replica over the whole run; the autoscaled one for less.
    for name in ("fixed-1", "fixed-max"):
        v = s[name]
        assert v["replica_seconds"] == pytest.approx(v["end_s"] * v["peak_replicas"])
    assert s["fixed-max"]["peak_replicas"] == 4
    for name in ("autoscaled", "autoscaled, cold start 60 s"):
        assert s[name]["replica_seconds"] < s["fixed-max"]["replica_seconds"], name
        assert s[name]["cost_vs_fixed_max"] < 1.0


def test_the_policy_scales_up_down_to_zero_and_back(run: tuple[dict, dict]) -> None:
    _, data = run
    auto = data["scenarios"]["autoscaled"]
    events = auto["scale_events"]
    reasons = [e[3] for e in events]
    assert set(reasons) <= REASONS
    assert "ScaleUp" in reasons and "ScaleDown" in reasons
    to_zero = next(e for e in events if e[3] == "ScaleToZero")
    back = next(e for e in events if e[3] == "ColdStart")
    assert 600 <= to_zero[0] < 1000 <= back[0]  # idle stretch 600-1000 s: zero inside it, back after it
    assert auto["cold_starts_from_zero"] == 1 and auto["held_at_gateway"] > 0
    assert 1 < auto["peak_replicas"] <= 4
    assert 0 in auto["replicas_per_minute"]
    # Held requests waited for the cold start: the slowest TTFT is at least the cold start's 30 s.
    assert auto["ttft_s"]["max"] >= 30
    # A longer cold start costs latency.
    slower = data["scenarios"]["autoscaled, cold start 60 s"]
    assert slower["ttft_s"]["p99"] >= auto["ttft_s"]["p99"] and slower["ttft_s"]["max"] >= 60


def test_same_seed_same_numbers(tmp_path: Path, run: tuple[dict, dict]) -> None:
    _, data = run
    again = autoscale.main([*SHORT, "--out", str(tmp_path / "again.json")])
    assert json.loads(json.dumps(again["scenarios"])) == data["scenarios"]
