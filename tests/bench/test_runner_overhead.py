"""``bench/runner_overhead.py --quick``: both paths (eager, decode buffers) report every host-side part per
decode step, the parts add up to the host total, and the decode-buffer path really went through them (the
script raises otherwise). No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
PARTS = ("update_states", "step_arrays", "device_inputs", "sampling_metadata", "sample_bookkeeping")


def test_quick_run_reports_every_part_of_both_paths(tmp_path):
    out = tmp_path / "runner_overhead.json"
    cmd = [sys.executable, "-m", "bench.runner_overhead", "--quick", "--out", str(out)]
    cmd += ["--model-cache", str(tmp_path / "models")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "runner_overhead"
    assert set(result["paths"]) == {"eager", "decode-buffers"}
    for name, path in result["paths"].items():
        assert path["steps"] > 0, name
        median = path["median_ms"]
        for part in (*PARTS, "host_total", "model_forward", "sampler"):
            assert median[part] >= 0, (name, part)
        # The host total is the sum of its parts step by step, so the medians cannot exceed it by much.
        assert max(median[p] for p in PARTS) <= path["p90_ms"]["host_total"], name
        assert median["model_forward"] > 0, name  # the real model ran
        assert result["target"]["met"][name] in (True, False)
    assert "host total" in proc.stdout
