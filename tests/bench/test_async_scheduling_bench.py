"""bench/async_scheduling.py's smoke run: both modes on the modelled device, identical outputs (the bench
raises otherwise), and only the async engine launches steps while another is in flight."""

from __future__ import annotations

import json

from bench import async_scheduling


def test_smoke_run(tmp_path):
    out = tmp_path / "async.json"
    result = async_scheduling.main(["--quick", "--out", str(out)])
    summary = result["summary"]
    assert set(summary) == {"step-by-step", "async"}
    assert summary["step-by-step"]["overlapped_steps"] == 0
    assert summary["async"]["overlapped_steps"] > 0
    for s in summary.values():
        assert s["steps"] > 0 and s["device_s"] > 0
    assert json.loads(out.read_text())["async_vs_step_by_step"] > 0
