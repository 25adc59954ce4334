"""``kvfleet up``: the platform on this machine, without Kubernetes, for a person to try.

It starts, each as its own process in its own session (so a Ctrl-C in the terminal reaches only this
program, which then stops them in order):

1. ``redis-server`` on 127.0.0.1 (a free port unless ``--redis-port``), no persistence, requiring a random
   password (like the chart's Redis), which reaches it in a config file and the engines and the gateway in
   their environment (``KVFLEET_REDIS_URL``), never on a command line (which every local user can read in
   ``ps``), like every other secret: the admin token, the replica key root and key;
2. ``--replicas`` engine replicas, ``kvfleet engine serve``, of the model (default: the ``small`` demo model,
   built once with ``kvfleet demo-model`` into ``~/.cache/kvfleet/demo-llama-small``);
3. the gateway, ``kvfleet gateway``, on ``--port``, with the admin token and the replica key root (it
   derives each engine's admin token from the root, to sleep and wake them);

then creates a tenant through the gateway's admin API, prints its API key, and sends one chat request
through the gateway. ``--once`` stops there (exit status 0 only if every step worked); otherwise it prints
how to use the platform and runs until Ctrl-C. ``--with-operator`` instead runs the Kubernetes flavour in
this process (``kvfleet_devkit.local_platform``: Kubernetes API emulator, operator, pod runner; the ``local``
extra), imported only then.

Invariants: without ``--with-operator`` this module only starts subprocesses (it never imports torch, the
engine or the gateway: the ``kvfleet`` console script stays light), talks HTTP with the standard library only
(the base install has no HTTP client library), and leaves no process behind: every child is a process-group leader, and teardown
SIGTERMs each group, waits, then SIGKILLs whatever is left of it. A child that dies while the platform
starts (or later) ends the run with its log's tail and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvfleet_common import replica_credentials
from kvfleet_common.redis_url import mask_url
from kvfleet_devkit.processes import free_port

T = TypeVar("T")

KVFLEET = (sys.executable, "-m", "kvfleet_cli.main")  # the console script, in this interpreter
DEMO_PRESET = "small"
DEFAULT_MAX_MODEL_LEN = 2048
STOP_TIMEOUT_S = 40.0  # an engine drains in-flight requests on SIGTERM (there are none at shutdown)
DEMO_PROMPT = "Tell me about the lighthouse on the hill."
# Proxies from the environment must not intercept requests to 127.0.0.1.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class UpError(Exception):
    """A step failed; the message says which and why (with a child's log tail where one died)."""


# ---- child processes ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(slots=True)
class Children:
    """The processes of one run, each the leader of its own process group (``start_new_session``)."""

    run_dir: Path
    env: dict[str, str]
    started: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start ``argv`` with this run's environment plus ``env``."""
        log_path = self.run_dir / f"{name}.log"
        with log_path.open("wb") as log:  # this run's output only (a reused --run-dir)
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})}, start_new_session=True,
            )  # fmt: skip
        child = Child(name, proc, log_path)
        self.started.append(child)
        say(f"started {name} (pid {proc.pid}, log {log_path})")
        return child

    def check_alive(self) -> None:
        for c in self.started:
            rc = c.proc.poll()
            if rc is not None:
                raise UpError(f"{c.name} exited with status {rc}; the end of {c.log_path}:\n{c.log_tail()}")

    def stop(self) -> None:
        """Gateway and engines first (they deregister from Redis), Redis last; then no process is left."""
        first = [c for c in self.started if c.name != "redis-server"]
        last = [c for c in self.started if c.name == "redis-server"]
        for group in (first, last):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for c in group:
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    say(f"{c.name} did not stop within {STOP_TIMEOUT_S:.0f} s; killing it")
        for c in self.started:  # the rest of each group (an engine's core process) goes with its leader
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        self.started.clear()


# ---- small helpers --------------------------------------------------------------------------------------


def say(message: str) -> None:
    print(f"[kvfleet up] {message}", flush=True)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` (as servers do, SO_REUSEADDR: TIME_WAIT leftovers of an
    earlier run do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def http(
    method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 10.0
) -> tuple[int, Any, dict[str, str]]:
    """One JSON request with the standard library: (status, decoded body or text, headers).
    Raises OSError (urllib.error.URLError included) when nothing answered."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _HTTP.open(req, timeout=timeout) as resp:
            status, raw, hdrs = resp.status, resp.read(), dict(resp.headers.items())
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers.items())
    try:
        return status, json.loads(raw), {k.lower(): v for k, v in hdrs.items()}
    except ValueError:
        return status, raw.decode(errors="replace"), {k.lower(): v for k, v in hdrs.items()}


def wait_for(children: Children, what: str, check: Callable[[], T | None], timeout: float) -> T:
    """Poll ``check`` until it returns something truthy; fail if a child dies or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        children.check_alive()
        try:
            result = check()
        except OSError:  # not listening yet
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise UpError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfleet"


def max_model_len(model_dir: Path, wanted: int) -> int:
    """``wanted``, capped by what the model supports (``config.json``; read without the engine)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UpError(f"{model_dir} is not a model directory (config.json: {e})") from None
    return min(wanted, int(config.get("max_position_embeddings") or wanted))


def missing_extras() -> list[str]:
    """Extras whose packages are not installed (looked up, not imported)."""
    out = []
    if importlib.util.find_spec("torch") is None:
        out.append("engine")
    if any(importlib.util.find_spec(m) is None for m in ("kvfleet_gateway", "httpx", "uvicorn", "fastapi")):
        out.append("gateway")
    return out


# ---- the steps --------------------------------------------------------------------------------------------


def _has_current_chat_template(model_dir: Path) -> bool:
    from kvfleet_engine.demo_model.tokenizer import CHAT_TEMPLATE

    try:
        saved = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return False
    return saved == CHAT_TEMPLATE


def demo_model(children: Children, out: Path, timeout: float) -> Path:
    """The demo model in ``out``, built there once (into a temporary sibling, then renamed: an interrupted
    build never looks complete). A build whose chat template is not today's (an older kvfleet's, without
    tool rendering, say) is built again: the served prompts would otherwise differ from the documented ones."""
    if (out / "config.json").exists():
        if _has_current_chat_template(out):
            return out
        say(f"the demo model in {out} has an older chat template: building it again")
        shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    say(f"building the demo model ({DEMO_PRESET} preset) into {out} (once; reused next time)")
    child = children.start("demo-model", [*KVFLEET, "demo-model", "--out", str(tmp), "--preset", DEMO_PRESET])
    try:
        rc = child.proc.wait(timeout)
        if rc != 0:
            raise UpError(f"kvfleet demo-model failed ({rc}):\n{child.log_tail()}")
        tmp.rename(out)
    except subprocess.TimeoutExpired:
        raise UpError(f"building the demo model took longer than {timeout:.0f} s") from None
    except OSError:
        if not (out / "config.json").exists():  # else: built meanwhile by another run, fine
            raise
    finally:
        children.started.remove(child)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; a partial build otherwise
    return out


def start_redis(children: Children, port: int) -> str:
    """redis-server requiring a random password (from a config file only this user can read); its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise UpError("redis-server is not installed (Debian/Ubuntu: sudo apt-get install redis-server)")
    data = children.run_dir / "redis"
    data.mkdir(exist_ok=True)
    password = secrets.token_hex(16)
    config = data / "redis.conf"
    config.unlink(missing_ok=True)  # a reused --run-dir: created anew with mode 0600
    with os.fdopen(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(f"requirepass {password}\n")
    children.start("redis-server", [
        exe, str(config), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(data), "--protected-mode", "no",
    ])  # fmt: skip

    def pong() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            replies = b""
            while replies.count(b"\r\n") < 2 and (chunk := s.recv(64)):
                replies += chunk
            return replies == b"+OK\r\n+PONG\r\n"

    wait_for(children, "redis-server to answer PING", pong, 30)
    return f"redis://:{password}@127.0.0.1:{port}/0"


@dataclass(slots=True)
class Platform:
    gateway_url: str
    model: str
    admin_token: str
    engines: list[str]  # base URLs


def bring_up(args: argparse.Namespace, children: Children) -> Platform:
    model_dir = args.model_dir or demo_model(
        children, cache_dir() / f"demo-llama-{DEMO_PRESET}", args.timeout
    )
    model_dir = Path(model_dir).resolve()
    mml = max_model_len(model_dir, args.max_model_len)
    redis_url = start_redis(children, args.redis_port or free_port())
    redis_env = {"KVFLEET_REDIS_URL": redis_url}  # the password stays off every command line
    # Replica credentials as the operator issues them: the gateway holds the root, the engines their model's key
    # (and derive their admin token from it), so the gateway routes only to replicas that signed their heartbeats.
    root = replica_credentials.new_root()
    model_key = replica_credentials.model_key(bytes.fromhex(root), args.model_name)
    engine_env = {**redis_env, "KVFLEET_REPLICA_KEY": model_key.hex()}
    say(f"redis-server: {mask_url(redis_url)}; model {model_dir} served as {args.model_name!r}")
    engines = []
    for i in range(args.replicas):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        children.start(f"engine-{i}", [
            *KVFLEET, "engine", "serve", "--model", str(model_dir), "--served-model-name", args.model_name,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(mml),
            "--replica-name", f"{args.model_name}-{i}", "--base-url", url,
        ], env=engine_env)  # fmt: skip
        engines.append(url)
    gateway = f"http://127.0.0.1:{args.port}"
    children.start("gateway", [
        *KVFLEET, "gateway", "--host", "127.0.0.1", "--port", str(args.port),
    ], env={**redis_env, "KVFLEET_ADMIN_TOKEN": args.admin_token, "KVFLEET_REPLICA_KEY_ROOT": root})  # fmt: skip
    say(f"waiting for {args.replicas} engine replica(s) to load the model and for the gateway...")
    for url in [gateway, *engines]:
        wait_for(children, f"{url}/health", lambda u=url: http("GET", f"{u}/health")[0] == 200, args.timeout)

    def all_awake() -> bool:
        status, body, _ = http("GET", f"{gateway}/admin/models", token=args.admin_token)
        models = {m["name"]: m for m in body.get("data", [])} if status == 200 else {}
        replicas = models.get(args.model_name, {}).get("replicas", [])
        return len(replicas) == args.replicas and all(r["state"] == "awake" for r in replicas)

    wait_for(children, f"{args.replicas} awake replica(s) in Redis", all_awake, args.timeout)
    return Platform(gateway, args.model_name, args.admin_token, engines)


def create_tenant(p: Platform, name: str) -> str:
    status, body, _ = http("POST", f"{p.gateway_url}/admin/tenants", {"name": name}, token=p.admin_token)
    if status != 201:
        raise UpError(f"creating tenant {name!r} failed: HTTP {status} {body}")
    return body["api_key"]


def demo_request(children: Children, p: Platform, key: str, timeout: float) -> None:
    """One chat completion through the gateway (once its fleet snapshot lists the model), printed."""

    def listed() -> bool:
        status, body, _ = http("GET", f"{p.gateway_url}/v1/models", token=key)
        return status == 200 and p.model in [m["id"] for m in body["data"]]

    wait_for(children, f"the gateway to route {p.model!r}", listed, 60)
    body = {"model": p.model, "messages": [{"role": "user", "content": DEMO_PROMPT}], "max_tokens": 32,
            "min_tokens": 4, "temperature": 0}  # fmt: skip
    say(f"POST {p.gateway_url}/v1/chat/completions  {json.dumps(body)}")
    started = time.monotonic()
    status, resp, headers = http(
        "POST", f"{p.gateway_url}/v1/chat/completions", body, token=key, timeout=timeout
    )
    if status != 200:
        raise UpError(f"the demo request failed: HTTP {status} {resp}")
    took = time.monotonic() - started
    say(f"-> {resp['choices'][0]['message']['content']!r}")
    say(f"   served by replica {headers.get('x-kvfleet-replica')} in {took:.2f} s; usage {resp['usage']}")


def print_usage(p: Platform, key: str, tenant: str, run_dir: Path) -> None:
    hello = {"model": p.model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    print(
        f"""
kvfleet is up: gateway {p.gateway_url}, model "{p.model}" ({len(p.engines)} replicas), tenant "{tenant}".

  export OPENAI_BASE_URL={p.gateway_url}/v1 OPENAI_API_KEY={key}
  curl $OPENAI_BASE_URL/chat/completions -H "Authorization: Bearer $OPENAI_API_KEY" \\
    -H 'content-type: application/json' -d '{json.dumps(hello)}'
  python -c 'import openai; print(openai.OpenAI().chat.completions.create(model="{p.model}", \\
    messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)'

Admin API (tenants, keys, usage, models, sleep/wake), admin token {p.admin_token}:
  curl -H 'Authorization: Bearer {p.admin_token}' {p.gateway_url}/admin/models
  curl -X POST -H 'Authorization: Bearer {p.admin_token}' {p.gateway_url}/admin/models/{p.model}/sleep
Logs: {run_dir}/*.log     Metrics: {p.gateway_url}/metrics     Ctrl-C stops everything.
""",
        flush=True,
    )


# ---- --with-operator ------------------------------------------------------------------------------------


def run_with_operator(args: argparse.Namespace) -> int:
    """The local platform's own entry point, in this process: Ctrl-C and the exit status are its."""
    try:
        from kvfleet_devkit import local_platform
    except ImportError as e:  # KMock, or an extra the platform runs (the operator's CRDs)
        print(f"kvfleet up --with-operator: missing dependency {e.name or e}; "
              "pip install 'kvfleet[local,operator,engine,gateway]'", file=sys.stderr)  # fmt: skip
        return 2
    argv = ["--with-gateway", "--gateway-port", str(args.port)]
    if args.admin_token_given:
        argv.append(f"--admin-token={args.admin_token}")
    if args.once:
        argv.append("--once")
    say(f"--with-operator: running python -m kvfleet_devkit.local_platform {' '.join(argv)}")
    return local_platform.main(argv)


# ---- entry point ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet up",
        description="Run kvfleet on this machine: redis-server, engine replicas of a model and the gateway; "
        "create a tenant, print its API key and send a chat request through the gateway.",
    )
    p.add_argument("--model-dir", type=Path, default=None,
                   help=f"model to serve (default: the {DEMO_PRESET} demo model, built once into "
                   f"{cache_dir() / f'demo-llama-{DEMO_PRESET}'})")  # fmt: skip
    p.add_argument("--model-name", default="demo", help="the model id clients use (default: demo)")
    p.add_argument("--replicas", type=int, default=None, help="engine replicas (default 2)")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port (default 8080)")
    p.add_argument("--redis-port", type=int, default=None, help="redis-server's port (default: a free one)")
    p.add_argument(
        "--admin-token", default=None, help="admin token of the gateway and engines (default: random)"
    )
    p.add_argument("--tenant", default="demo", help="name of the tenant to create (default: demo)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help=f"engines' context length, capped by the model's (default {DEFAULT_MAX_MODEL_LEN})")  # fmt: skip
    p.add_argument("--run-dir", type=Path, default=None, help="logs and Redis data (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each start-up step may take")
    p.add_argument("--once", action="store_true", help="send the demo request, print it, stop everything")
    p.add_argument("--with-operator", action="store_true",
                   help="the Kubernetes flavour: API emulator, operator and pod runner around the engines "
                   "(kvfleet_devkit.local_platform; the local extra)")  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.admin_token_given = args.admin_token is not None
    if args.admin_token is None:
        args.admin_token = secrets.token_hex(16)
    if len(args.admin_token) < 8:
        parser.error("--admin-token must be at least 8 characters")
    if args.with_operator:
        if args.model_dir or args.replicas or args.redis_port:
            parser.error("--with-operator serves examples/local-tiny.yaml (scale it with kubectl); "
                         "--model-dir, --replicas and --redis-port do not apply")  # fmt: skip
        return run_with_operator(args)
    args.replicas = 2 if args.replicas is None else args.replicas
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    missing = missing_extras()
    if missing:
        print(f"kvfleet up: the {' and '.join(missing)} extra(s) are not installed: "
              f"pip install 'kvfleet[{','.join(missing)}]'", file=sys.stderr)  # fmt: skip
        return 2
    if not port_is_free(args.port):
        print(f"kvfleet up: port {args.port} is in use; pick another with --port", file=sys.stderr)
        return 2
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="kvfleet-up-"))).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # the flags (and Children.start's env) say everything
    env = {k: v for k, v in env.items() if not k.startswith("KVFLEET_")}
    children = Children(run_dir, env)
    say(f"run dir {run_dir}")

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    status, up = 0, False
    try:
        platform = bring_up(args, children)
        key = create_tenant(platform, args.tenant)
        say(f"tenant {args.tenant!r} created; its API key: {key}")
        demo_request(children, platform, key, args.timeout)
        up = True
        if not args.once:
            print_usage(platform, key, args.tenant, run_dir)
            while True:
                children.check_alive()
                time.sleep(1.0)
    except (UpError, OSError) as e:  # OSError: a request that got no answer in time
        say(f"error: {e}")
        status = 1
    except KeyboardInterrupt:
        status = 0 if up else 130
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        say("stopping...")
        children.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        say(f"stopped (logs in {run_dir})")
    return status
