"""``bench/adversarial.py --quick``: the gateway-under-abuse sweep against a real Redis, real simulated
replicas and a real gateway, run as the script it is. It must exit 0 with no 5xx answered anywhere (the
gateway counts only the streams the replica kill cut, which reached their clients as a 200 and an SSE
error event) and every leak and shutdown check passed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the simulated replicas are engine servers

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_quick_sweep_passes_with_no_5xx_and_no_leak(tmp_path: Path) -> None:
    out = tmp_path / "adversarial.json"
    argv = [sys.executable, "-m", "bench.adversarial", "--quick", "--out", str(out),
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["rounds"] >= 1

    x = data["five_xx"]
    assert x["client"] == 0 and x["replicas"] == 0, x
    assert x["gateway"] == x["gateway_expected"] >= 1, x  # the cut streams, and nothing else

    attacks = data["attacks"]
    assert len(attacks) == 11, list(attacks)
    for name, attack in attacks.items():
        assert attack["ok"] and attack["requests"] > 0 and attack["checks"], (name, attack)
        assert not [s for s in attack["statuses"] if s.startswith("5")], (name, attack["statuses"])

    leaks = data["leak_checks"]
    assert {c["when"] for c in leaks} == {"leaks after the attacks", "leaks after the kill", "shutdown"}
    assert all(c["ok"] for c in leaks), [c for c in leaks if not c["ok"]]
    names = {c["name"] for c in leaks}
    for expected in ("Redis: no kvf:inflight:* lease", "gateway in-flight gauge 0",
                     "no process of the fleet left", "gateway exits within 4 s"):  # fmt: skip
        assert expected in names, sorted(names)
