"""Where the gateway's CPU time goes (``bench/gateway_overhead.py --profile``): py-spy samples the gateway from
outside while it serves extra rounds; the collapsed stacks are summarised per function (self and inclusive)
and per library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import _fleet as fleet_mod
from bench import _fleet_metrics as fleet_metrics
from bench._gateway_overhead_load import make_prompts, open_client, run_round

_LIBRARIES = (
    ("opentelemetry", "opentelemetry"), ("uvicorn", "uvicorn"), ("h11", "h11"), ("httptools", "uvicorn"),
    ("httpcore", "httpx/httpcore"), ("httpx", "httpx/httpcore"), ("anyio", "anyio"), ("starlette", "starlette"),
    ("fastapi", "fastapi"), ("pydantic", "pydantic"), ("transformers", "tokenizer (transformers)"),
    ("tokenizers", "tokenizer (transformers)"), ("jinja2", "chat template (jinja2)"), ("redis", "redis-py"),
    ("prometheus_client", "prometheus_client"), ("kvfleet_gateway", "kvfleet_gateway"),
    ("kvfleet_common", "kvfleet_common"), ("asyncio", "asyncio"), ("selectors", "asyncio"), ("json", "json"),
    ("logging", "logging"),
)  # fmt: skip


def _library(frame: str) -> str:
    """The library a ``func (path:line)`` frame belongs to (py-spy ``--full-filenames`` paths)."""
    path = frame[frame.rfind("(") + 1 :]
    for needle, name in _LIBRARIES:
        if (
            f"/{needle}/" in path
            or f"/{needle}.py" in path
            or path.startswith((f"{needle}/", f"{needle}.py"))
        ):
            return name
    if "site-packages" not in path and ("/lib/python3" in path or path.startswith("<frozen")):
        return "python (other stdlib)"
    return "other"


def _short(frame: str) -> str:
    """``"func (/.../site-packages/pkg/mod.py:12)"`` -> ``"func (pkg/mod.py)"``: one name per function."""
    name, sep, where = frame.rpartition(" (")
    if not sep:
        return frame
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker, keep in (("site-packages/", ""), ("/gateway/kvfleet_gateway/", "kvfleet_gateway/"),
                         ("/common/kvfleet_common/", "kvfleet_common/")):  # fmt: skip
        if marker in path:
            path = keep + path.split(marker, 1)[1]
            break
    else:
        m = re.search(r"/lib/python3\.\d+/", path)
        if m:
            path = path[m.end() :]
    return f"{name} ({path})"


def summarize_profile(raw: str, top: int = 25) -> dict[str, Any]:
    """py-spy ``--format raw`` (collapsed stacks ``f1;f2;...;fn count``): share of samples per function
    (self: innermost frame; inclusive: anywhere on the stack) and per library (innermost frame's)."""
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    libs: Counter[str] = Counter()
    libs_incl: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        full = stack.split(";")
        frames = [_short(f) for f in full]
        total += n
        self_t[frames[-1]] += n
        libs[_library(full[-1])] += n
        for f in set(frames):
            incl[f] += n
        for lib in {_library(f) for f in full}:
            libs_incl[lib] += n

    def share(c: Counter[str]) -> list[list[Any]]:
        return [[k, round(v / total, 4)] for k, v in c.most_common(top)] if total else []

    return {"samples": total, "self": share(self_t), "inclusive": share(incl), "library_self": share(libs),
            "library_inclusive": share(libs_incl)}  # fmt: skip


async def _profile_rounds(
    fl: fleet_mod.Fleet, args: argparse.Namespace, tokenizer: Any, words: list[str]
) -> int:
    assert fl.api_key is not None
    n = 0
    async with open_client(args, fl.gateway_url, fl.api_key) as c:
        per_round = (
            args.requests_per_round if args.load == "paced" else args.concurrency * args.requests_per_client
        )
        for k in range(args.profile_rounds):
            texts = make_prompts(args, tokenizer, words, per_round, 50 + k)
            got, _, _ = await run_round(c, "gateway", 100 + k, texts, args, args.seed * 1000 + 50 + k)
            n += len(got)
    return n


def profile_gateway(fl: fleet_mod.Fleet, args: argparse.Namespace, tokenizer: Any, words: list[str],
                    log_dir: Path) -> dict[str, Any]:  # fmt: skip
    """Attach py-spy to the gateway (sampling from outside: ~no overhead inside it) while it serves
    ``--profile-rounds`` extra rounds; summarise where its CPU time went."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).is_file():
        return {"error": "py-spy is not installed"}
    assert fl.gateway is not None
    out = log_dir / "gateway-profile.txt"
    cmd = [exe, "record", "--pid", str(fl.gateway.pid), "--rate", "250", "--format", "raw", "--nonblocking",
           "--full-filenames", "-o", str(out)]  # fmt: skip
    with (log_dir / "py-spy.log").open("wb") as log:
        spy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.0)  # attached
        cpu0 = fleet_metrics.cpu_seconds([fl.gateway.pid])
        n = asyncio.run(_profile_rounds(fl, args, tokenizer, words))
        cpu = fleet_metrics.cpu_seconds([fl.gateway.pid]) - cpu0
    finally:
        spy.send_signal(2)  # SIGINT: py-spy writes what it recorded and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(30)
        if spy.poll() is None:
            spy.kill()
            spy.wait()
    if not out.is_file():
        return {"error": f"py-spy wrote nothing (see {log_dir / 'py-spy.log'})"}
    return {"requests": n, "gateway_cpu_ms_per_request": 1e3 * cpu / n if n else None, "file": str(out),
            **summarize_profile(out.read_text())}  # fmt: skip
