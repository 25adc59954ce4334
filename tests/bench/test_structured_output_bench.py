"""``bench/structured_output.py`` end to end on the tiny demo model with a handful of requests: both runs
produce the same output tokens per request, every constrained response completes and validates, and the
compile measurements are there. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_reports_both_runs_and_the_compile_cost(tmp_path):
    out = tmp_path / "structured_output.json"
    cmd = [sys.executable, "-m", "bench.structured_output", "--preset", "tiny", "--num-prompts", "6"]
    cmd += [
        "--repeats",
        "2",
        "--compile-schemas",
        "2",
        "--model-cache",
        str(tmp_path / "models"),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "structured_output"
    t = result["throughput"]
    assert t["num_requests"] == 6 and t["output_tokens"] > 0
    assert [len(t["runs"][k]) for k in ("constrained", "unconstrained")] == [2, 2]
    assert t["conformance"] == {"responses": 6, "finished_stop": 6, "valid": 6}
    assert t["slowdown"] == pytest.approx(
        t["median_wall_s"]["constrained"] / t["median_wall_s"]["unconstrained"] - 1
    )
    c = result["compile"]
    assert len(c["schemas"]) == 2 * 3 and c["engine_compiles"] == 2 * 3  # each "new" schema missed the cache
    assert c["library"]["median_compile_ms"] > 0
    assert result["targets"]["met"] in (True, False)
    assert "slowdown" in proc.stdout
