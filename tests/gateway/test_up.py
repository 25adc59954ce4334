"""``kvfleet up --once`` for real: redis-server, two tiny engine replicas and the gateway as processes; a tenant,
its key and one chat request through the gateway; then nothing left running, and no secret was ever on a
child's command line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfleet_cli import up
from kvfleet_devkit.processes import free_port, group_members

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def descendants(ancestor: int) -> dict[int, list[str]]:
    """The live processes below ``ancestor`` (children, grandchildren, ...) and their command lines, which any
    local user can read like this (/proc/PID/cmdline, what ``ps`` shows)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found: dict[int, list[str]] = {}
    for pid in parents:
        up = parents[pid]
        while up not in (0, 1, ancestor) and up in parents:
            up = parents[up]
        if up == ancestor:
            with contextlib.suppress(OSError):
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return found


def kvfleet_up(
    *args: str, work_dir: Path, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], dict[str, int], list[list[str]]]:
    """Run ``kvfleet up``; its result, the children it reported starting (name -> pid = process group), and the
    command line of every process it started (directly or not), sampled while it ran."""
    out, err = work_dir / "up.out", work_dir / "up.err"
    argv = [sys.executable, "-m", "kvfleet_cli.main", "up", *args]
    command_lines: dict[tuple[int, tuple[str, ...]], list[str]] = {}
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise subprocess.TimeoutExpired(argv, timeout)
            for pid, cmdline in descendants(proc.pid).items():
                command_lines.setdefault((pid, tuple(cmdline)), cmdline)
            time.sleep(0.2)
    done = subprocess.CompletedProcess(argv, proc.returncode, out.read_text(), err.read_text())
    children = {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+),", done.stdout)}
    return done, children, list(command_lines.values())


def test_up_once_serves_a_chat_request_through_the_gateway_and_leaves_nothing(demo_model, tmp_path):
    run_dir = tmp_path / "run"
    admin_token = "up-admin-" + secrets.token_hex(12)
    proc, children, command_lines = kvfleet_up(
        "--once", "--model-dir", str(demo_model("llama", "tiny")), "--port", str(free_port()),
        "--run-dir", str(run_dir), "--tenant", "acme", f"--admin-token={admin_token}", work_dir=tmp_path,
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
    # No secret on any child's command line (readable by every local user): the admin token (the gateway
    # got it, or creating the tenant would have failed), Redis's password, the replica key root and keys
    # (64 hex digits) all travel in the environment.
    (password,) = re.findall(r"^requirepass (\S+)$", (run_dir / "redis" / "redis.conf").read_text(), re.M)
    started = {" ".join(c[3:6]) for c in command_lines if c[1:3] == ["-m", "kvfleet_cli.main"]}
    assert {"gateway --host 127.0.0.1", "engine serve --model"} <= started  # the sampling saw them all
    assert len([c for c in command_lines if "redis-server" in c[0]]) == 1
    for cmdline in command_lines:
        text = " ".join(cmdline)
        assert admin_token not in text and password not in text, cmdline
        assert not re.search(r"[0-9a-f]{64}", text), cmdline


def test_a_child_dying_at_start_fails_with_its_log(tmp_path):
    """A replica that cannot load its model: the run stops with the engine's log tail and a non-zero status."""
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512}'
    )
    proc, children, _ = kvfleet_up(
        "--once", "--model-dir", str(model), "--replicas", "1", "--port", str(free_port()),
        "--run-dir", str(tmp_path / "run"), work_dir=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"error: engine-0 exited with status [1-9]", proc.stdout), proc.stdout
    assert "Traceback" in proc.stdout or "kvfleet engine serve:" in proc.stdout  # the log's tail is shown
    assert "API key" not in proc.stdout
    assert {name: left for name, pgid in children.items() if (left := group_members(pgid))} == {}


def test_a_cached_demo_model_with_an_older_chat_template_is_rebuilt(demo_model, tmp_path):
    """`kvfleet up` reuses its cached demo model only while its chat template is today's (a build from
    before tool rendering would serve other prompts than the docs and the gateway expect)."""
    current = demo_model(arch="llama")
    assert up._has_current_chat_template(current)
    stale = tmp_path / "stale"
    shutil.copytree(current, stale)
    config = json.loads((stale / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (stale / "tokenizer_config.json").write_text(json.dumps(config))
    assert not up._has_current_chat_template(stale)
    assert not up._has_current_chat_template(tmp_path / "missing")
