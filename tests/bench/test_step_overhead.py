"""``bench/step_overhead.py``: a ``--quick`` run on the tiny demo model writes its JSON with every component
per step and sane values (no timing assertions: only structure, counts and consistency)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"

from bench import step_overhead  # noqa: E402  (after the skip above)

COMPONENTS = ("schedule", "execute", "update", "output", "other", "total", "wall")


def _check_summary(summary: dict, runs: int) -> None:
    assert set(summary) == set(COMPONENTS)
    for name, c in summary.items():
        assert c["median_ms"] is not None and math.isfinite(c["median_ms"]) and c["median_ms"] >= 0, name
        assert c["p90_ms"] >= c["median_ms"] * (1 - 1e-9), name
        assert len(c["run_medians_ms"]) == runs, name
    parts = sum(summary[k]["mean_ms"] for k in ("schedule", "execute", "update", "output", "other"))
    assert parts == pytest.approx(summary["total"]["mean_ms"], rel=1e-6)  # the split adds up


def test_quick_run_writes_every_component(tmp_path: Path, demo_model) -> None:
    out = tmp_path / "step_overhead.json"
    argv = ["--quick", "--model", str(demo_model(preset="tiny")), "--out", str(out)]
    result = step_overhead.main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result, default=str))
    assert data["benchmark"] == "step_overhead"
    assert data["command"].startswith(".venv/bin/python -m bench.step_overhead --quick")
    w = data["workload"]
    assert w["num_seqs"] == 16 and w["repeats"] == 2 and w["prompt_len_range"] == [20, 100]
    assert data["engine_config"]["max_num_seqs"] == 16
    assert list(data["configs"]) == ["current"] and data["ratio_current_vs_baseline"] is None

    current = data["configs"]["current"]
    assert current["engine_package"].endswith("kvfleet_engine")
    _check_summary(current["summary"], runs=2)
    max_tokens = data["engine_config"]["max_tokens"]
    for run in current["runs"]:
        assert run["generated_tokens"] == 16 * max_tokens  # ignore_eos: every request runs to max_tokens
        assert run["text_chars"] > 0
        # Steady-state decode steps: all 16 decoding, nothing admitted or finishing; at least the asked 20.
        assert 20 <= run["steady_steps"] < run["steps"] <= max_tokens + 20

    target = data["target"]
    assert target["total_median_ms_max"] == 1.5
    assert target["total_median_ms"] == current["summary"]["total"]["median_ms"]
    assert target["met"] == (target["total_median_ms"] <= 1.5)


def test_baseline_tree_measures_both_trees(tmp_path: Path, demo_model) -> None:
    """Comparing the tree with itself: each configuration measured in a child process, ratios reported."""
    out = tmp_path / "cmp.json"
    argv = ["--quick", "--model", str(demo_model(preset="tiny")), "--decode-steps", "8", "--num-seqs", "4",
            "--repeats", "1", "--baseline-tree", str(BENCH_DIR.parent), "--out", str(out)]  # fmt: skip
    data = step_overhead.main(argv)
    assert json.loads(out.read_text())["benchmark"] == "step_overhead"
    assert list(data["configs"]) == ["current", "baseline"]
    for config in data["configs"].values():
        _check_summary(config["summary"], runs=1)
        assert len(config["runs"]) == 1 and config["runs"][0]["steady_steps"] >= 8
    rc = data["ratio_current_vs_baseline"]
    assert len(rc["paired_total_medians"]) == 1
    assert rc["total_median"] > 0 and rc["paired_median"] > 0


def test_strip_option_and_percentile() -> None:
    argv = ["--quick", "--out", "x.json", "--baseline-tree=/b", "--repeats", "3", "--seed", "1"]
    assert step_overhead.strip_option(argv, ("--out", "--baseline-tree", "--repeats")) == [
        "--quick",
        "--seed",
        "1",
    ]
    assert step_overhead.percentile([3.0, 1.0, 2.0, 4.0, 5.0], 0.5) == 3.0
    assert step_overhead.percentile([1.0, 2.0], 0.9) == pytest.approx(1.9)
    assert math.isnan(step_overhead.percentile([], 0.9))
