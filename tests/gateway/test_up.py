"""``kvfleet up --once`` for real: redis-server, two tiny engine replicas and the gateway as processes; a tenant,
its key and one chat request through the gateway; then nothing left running."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from kvfleet_devkit.processes import free_port, group_members

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def kvfleet_up(*args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """Run ``kvfleet up``; its result and the children it reported starting (name -> pid = process group)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet_cli.main", "up", *args],
        capture_output=True, text=True, timeout=timeout, start_new_session=True, check=False,
    )  # fmt: skip
    children = {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+),", proc.stdout)}
    return proc, children


def test_up_once_serves_a_chat_request_through_the_gateway_and_leaves_nothing(demo_model, tmp_path):
    run_dir = tmp_path / "run"
    proc, children = kvfleet_up(
        "--once", "--model-dir", str(demo_model("llama", "tiny")), "--port", str(free_port()),
        "--run-dir", str(run_dir), "--tenant", "acme",
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert sorted(children) == ["engine-0", "engine-1", "gateway", "redis-server"]
    assert re.search(r"tenant 'acme' created; its API key: kvf-[A-Za-z0-9_-]{20,}\n", out), out
    completion = re.search(r"-> '(.+)'\n.*served by replica (demo-[01])#\d+ ", out)
    assert completion and completion[1].strip(), out  # a real completion, from one of the two replicas
    assert "'completion_tokens': " in out and "stopped" in out.splitlines()[-1]
    for name in children:
        assert (run_dir / f"{name}.log").stat().st_size > 0
    # Every child led its own process group; each group is gone (an engine's core process included).
    assert {name: left for name, pgid in children.items() if (left := group_members(pgid))} == {}


def test_a_child_dying_at_start_fails_with_its_log(tmp_path):
    """A replica that cannot load its model: the run stops with the engine's log tail and a non-zero status."""
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512}'
    )
    proc, children = kvfleet_up(
        "--once", "--model-dir", str(model), "--replicas", "1", "--port", str(free_port()),
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"error: engine-0 exited with status [1-9]", proc.stdout), proc.stdout
    assert "Traceback" in proc.stdout or "kvfleet engine serve:" in proc.stdout  # the log's tail is shown
    assert "API key" not in proc.stdout
    assert {name: left for name, pgid in children.items() if (left := group_members(pgid))} == {}
