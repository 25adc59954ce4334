"""Start, probe and stop the OpenAI-compatible servers the serving benchmarks drive.

A server runs as a subprocess in its own session (process group), its output going to a log file. Stopping
sends SIGTERM to the whole group, waits for a grace period, then SIGKILLs whatever is left of the group, so
no child (the kvfleet engine-core process, uvicorn workers) outlives the benchmark. ``/proc`` helpers sum
the memory of a server's process tree (RSS and PSS: the tree's processes share pages, PSS counts a shared
page once over all of them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN_DIR = Path(sys.executable).parent


def kvfleet_argv() -> list[str]:
    """How to run the ``kvfleet`` CLI: the installed script beside this interpreter, or, where the sources
    are only on ``PYTHONPATH`` (a GPU image's own Python, scripts/test-gpu.sh's system mode), the module."""
    script = BIN_DIR / "kvfleet"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvfleet_cli.main"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- command lines -------------------------------------------------------------------------------


@dataclass(slots=True)
class ServerCommand:
    """What to run and how to talk to it. ``request_model`` is the ``model`` field requests must carry;
    ``extra_body`` is merged into every generation request (server-specific "generate exactly N tokens")."""

    kind: str
    argv: list[str]
    env: dict[str, str]
    base_url: str
    request_model: str | None
    extra_body_for: str  # profile name for `generation_extras`


def kvfleet_command(
    model_dir: Path,
    port: int,
    served_model_name: str,
    host: str = "127.0.0.1",
    max_model_len: int | None = None,
    admin_token: str | None = None,
    extra_args: Sequence[str] = (),
) -> ServerCommand:
    argv = [
        *kvfleet_argv(), "engine", "serve", "--model", str(model_dir),
        "--host", host, "--port", str(port), "--served-model-name", served_model_name,
    ]  # fmt: skip
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += list(extra_args)
    return ServerCommand(
        kind="kvfleet",
        argv=argv,
        # Secrets go in the environment: a command line is readable by every local user (ps, /proc).
        env={} if admin_token is None else {"KVFLEET_ADMIN_TOKEN": admin_token},
        base_url=f"http://{host}:{port}",
        request_model=served_model_name,
        extra_body_for="kvfleet",
    )


def transformers_command(
    model_dir: Path,
    port: int,
    host: str = "127.0.0.1",
    continuous_batching: bool = True,
    cb_block_size: int | None = None,
    cb_num_blocks: int | None = None,
    cb_max_batch_tokens: int | None = None,
    extra_args: Sequence[str] = (),
    hub_cache: Path | None = None,
) -> ServerCommand:
    """``transformers serve MODEL_DIR --device cpu --dtype float32 [--continuous-batching]`` through
    ``bench/hf_serve_cpu.py`` (see there: transformers refuses a ``device_map`` without ``accelerate``).

    The model directory is the server's forced model, so requests must name it exactly (or not at all).
    ``HF_HUB_OFFLINE=1`` keeps it off the network; ``HF_HUB_CACHE`` points at an empty directory because
    its ``/v1/models`` lists the hub cache and fails when there is none.
    """
    argv = [
        sys.executable, "-m", "bench.hf_serve_cpu", "serve", str(model_dir),  # run in REPO_ROOT (start)
        "--device", "cpu", "--dtype", "float32", "--host", host, "--port", str(port),
        "--log-level", "warning",
        "--continuous-batching" if continuous_batching else "--no-continuous-batching",
    ]  # fmt: skip
    for flag, value in (
        ("--cb-block-size", cb_block_size),
        ("--cb-num-blocks", cb_num_blocks),
        ("--cb-max-batch-tokens", cb_max_batch_tokens),
    ):
        if continuous_batching and value is not None:
            argv += [flag, str(value)]
    argv += list(extra_args)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if hub_cache is not None:
        env["HF_HUB_CACHE"] = str(hub_cache)
    return ServerCommand(
        kind="transformers",
        argv=argv,
        env=env,
        base_url=f"http://{host}:{port}",
        request_model=str(model_dir),
        extra_body_for="transformers-cb" if continuous_batching else "transformers",
    )


# ---- the process ---------------------------------------------------------------------------------


class ServerExited(RuntimeError):
    pass


@dataclass
class ServerProcess:
    """A server subprocess in its own process group. Use as a context manager: the group is stopped on exit,
    whatever happened inside."""

    command: ServerCommand
    log_path: Path
    threads: int | None = None
    proc: subprocess.Popen | None = None
    started_at: float | None = None  # perf_counter at Popen
    ready_s: float | None = None  # Popen -> first healthy answer
    needed_sigkill: bool | None = None  # whether anything of the group outlived SIGTERM + grace
    _log_file: Any = field(default=None, repr=False)

    def start(self) -> ServerProcess:
        env = {**os.environ, **self.command.env}
        if self.threads is not None:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[var] = str(self.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("wb")
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerExited(
                f"{self.command.kind} server exited with code {self.proc.returncode}; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )

    def wait_ready(self, timeout_s: float = 600.0, path: str = "/health", poll_s: float = 0.1) -> float:
        """Poll ``path`` until it answers 200; returns seconds from process start. Raises if the process dies
        or ``timeout_s`` passes."""
        assert self.started_at is not None, "server not started"
        deadline = time.perf_counter() + timeout_s
        with httpx.Client(base_url=self.command.base_url, timeout=5.0) as client:
            while True:
                self.check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(path).status_code == 200:
                        self.ready_s = time.perf_counter() - self.started_at
                        return self.ready_s
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"{self.command.kind} server not ready after {timeout_s:.0f}s; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0, linger_s: float = 5.0) -> int | None:
        """SIGTERM the process group; SIGKILL what is left of it ``grace_s`` later, or ``linger_s`` after the
        leader exited. Returns the leader's exit code (uvicorn re-raises the signal after a graceful shutdown,
        so a clean stop reads -15)."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        # The leader may be gone while a child (an engine core) still shuts down: give the rest of the group a
        # moment after a clean leader exit, then SIGKILL whatever is left of it.
        deadline = time.perf_counter() + (linger_s if self.proc.poll() is not None else 0.0)
        while _group_alive(pgid) and time.perf_counter() < deadline:
            time.sleep(0.1)
        self.needed_sigkill = _group_alive(pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        code = self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg; a group whose only members are zombies is finished.
    return any(_state(pid) not in ("Z", None) for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat_fields(int(entry.name))
            if stat is not None and int(stat[2]) == pgid:
                out.append(int(entry.name))
    return out


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, ...]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _state(pid: int) -> str | None:
    f = _stat_fields(pid)
    return f[0] if f else None


# ---- memory --------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from ``/proc``'s parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            f = _stat_fields(int(entry.name))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def _kib_fields(path: Path, names: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in names:
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def tree_memory(pid: int) -> dict[str, Any]:
    """Resident memory of ``pid``'s process tree: summed RSS (double-counts shared pages) and summed PSS
    (shared pages split between their users: the tree's real footprint), in bytes, per process too."""
    per: dict[int, Mapping[str, int]] = {}
    for p in process_tree(pid):
        status = _kib_fields(Path(f"/proc/{p}/status"), ("VmRSS",))
        rollup = _kib_fields(Path(f"/proc/{p}/smaps_rollup"), ("Pss",))
        if status:
            per[p] = {"rss": status.get("VmRSS", 0), "pss": rollup.get("Pss", 0)}
    return {
        "rss_bytes": sum(v["rss"] for v in per.values()),
        "pss_bytes": sum(v["pss"] for v in per.values()),
        "processes": {str(p): dict(v) for p, v in per.items()},
    }


def temp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
