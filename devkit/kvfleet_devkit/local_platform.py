"""A development harness: the whole kvfleet platform on one machine, standing in for a cluster.

`LocalPlatform` owns, in start order:

1. a real ``redis-server`` on a free port (``kvfleet_devkit.redis_server``);
2. KMock's Kubernetes emulator serving the Kubernetes API over HTTP (``kvfleet_devkit.kube_emulator``),
   with the CRDs registered, the ``default`` and ``kvfleet-system`` namespaces, and a kubeconfig file
   pointing at it, so ``kubectl --kubeconfig <work>/kubeconfig ...`` works (``apply`` needs
   ``--validate=false``: the emulator serves no OpenAPI schema);
3. the operator, for real, as its own process (``kvfleet operator --server URL --standalone``);
4. the pod runner (`podrunner.PodRunner`): the operator's Deployments become local ``kvfleet engine
   serve`` processes, their pod and Deployment status reported back like a kubelet would;
5. the gateway, only with ``with_gateway=True`` (``kvfleet gateway``, its own process, same Redis and admin
   token as the operator), so the example Tenant's API key works through it.

With ``otlp_endpoint`` the gateway and every engine pod export their spans there (OTLP/HTTP): the operator
renders the endpoint into the pod template (its ``--otlp-endpoint``), and the pod runner adds
``OTEL_BSP_SCHEDULE_DELAY=100`` to every container so a test sees spans within a fraction of a second.

`stop()` undoes it all in reverse and fails loudly if any process is left behind.

Run it for a person (``kvfleet up --with-operator`` runs it too, see docs/E2E.md)::

    .venv/bin/python -m kvfleet_devkit.local_platform            # Ctrl-C stops everything

It writes the tiny demo model into the ``kvfleet-models`` claim, applies ``examples/tenant.yaml`` and
``examples/local-tiny.yaml`` of the source checkout (an editable install; ``--no-examples`` without one),
waits until the model is Ready, prints how to use it, and waits.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvfleet_common.replica_credentials import new_root
from kvfleet_devkit.kube_emulator import KubeEmulator
from kvfleet_devkit.podrunner import PodRunner
from kvfleet_devkit.processes import free_port, kill_group
from kvfleet_devkit.redis_server import RedisServer
from kvfleet_operator import crds

log = logging.getLogger("kvfleet.devkit.platform")

# The source checkout this package runs from (an editable install): its examples/ and the default work dir.
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODELS_CLAIM = "kvfleet-models"  # examples/local-tiny.yaml: pvc://kvfleet-models/demo-llama-tiny
DEMO_MODEL_DIR = "demo-llama-tiny"
OPERATOR_NAMESPACE = "kvfleet-system"
ENGINE_IMAGE = "local/kvfleet-engine:dev"  # never pulled: the pod runner ignores images
STARTUP_TIMEOUT_S = 120.0
TENANT_KEY = "sk-team-a-change-me"  # examples/tenant.yaml (its Secret)
DEMO_MODEL = "demo-tiny"  # examples/local-tiny.yaml
# Export finished spans every 100 ms instead of the SDK's 5 s: tests wait for them.
OTEL_FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
    """SIGTERM, wait, SIGKILL its process group (it was started in its own session)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s, killing", proc.pid, timeout)
    kill_group(proc.pid)  # whatever it started in its session goes with it
    proc.wait()


class LocalPlatform:
    """Redis + Kubernetes API + operator + pod runner (+ gateway) on this machine; a context manager.

    ``work_dir`` holds everything (logs, kubeconfig, claims, pod directories); a temporary one is made and
    removed again when none is given. After `start`: ``redis_url``, ``kube_url``, ``kubeconfig``,
    ``models_root`` (the ``kvfleet-models`` claim), ``runner`` (the pod runner), ``admin_token``, and with
    the gateway ``gateway_url``. ``gateway_port``: the gateway's port (default: a free one).
    ``otlp_endpoint``: an OTLP/HTTP endpoint (``http://host:port``) the gateway and the engines export
    their spans to. ``operator_autoscale_s``: the operator's autoscaler tick; ``gateway_args``: extra
    ``kvfleet gateway`` flags (e.g. ``--wake-timeout``).
    """

    def __init__(
        self,
        work_dir: Path | None = None,
        *,
        with_gateway: bool = False,
        admin_token: str = "local-admin-token",
        operator_idle_check_s: float = 2.0,
        probe_period_s: float = 0.5,
        gateway_port: int | None = None,
        otlp_endpoint: str | None = None,
        operator_autoscale_s: float = 2.0,
        gateway_args: Sequence[str] = (),
    ) -> None:
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="kvfleet-local-")).resolve()
        self.with_gateway = with_gateway
        self.admin_token = admin_token
        self.replica_key_root = new_root()  # the operator's and the gateway's, as the chart gives them
        self.operator_idle_check_s = operator_idle_check_s
        self.probe_period_s = probe_period_s
        self.gateway_port = gateway_port
        self.otlp_endpoint = otlp_endpoint
        self.operator_autoscale_s = operator_autoscale_s
        self.operator_metrics_port = 0  # set when the operator starts
        self.gateway_args = tuple(gateway_args)
        self.pvc_root = self.work_dir / "pvc"
        self.models_root = self.pvc_root / MODELS_CLAIM
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.redis: RedisServer | None = None
        self.kube: KubeEmulator | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.runner: PodRunner | None = None
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_url: str | None = None
        self._started = False

    # ---- lifecycle ------------------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        assert self.redis is not None, "not started"
        return self.redis.url

    @property
    def kube_url(self) -> str:
        assert self.kube is not None, "not started"
        return self.kube.url

    def start(self) -> LocalPlatform:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.models_root.mkdir(parents=True, exist_ok=True)
        self._started = True
        atexit.register(self.stop)  # an interrupted test run or script must not leave engines running
        try:
            self.redis = RedisServer(workdir=self.work_dir / "redis")
            self.redis.workdir.mkdir(exist_ok=True)
            self.redis.start()
            self.kube = KubeEmulator().start()
            for crd in crds.all_crds().values():
                self.kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            self._write_kubeconfig()
            self._start_operator()
            self.runner = PodRunner(
                self.kube.url,
                pvc_root=self.pvc_root,
                work_dir=self.work_dir,
                probe_period_s=self.probe_period_s,
                extra_env=self._pod_env(),
            ).start()
            if self.with_gateway:
                self.start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop everything, newest first; idempotent. Raises if a process the pod runner started is left."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        errors: list[BaseException] = []
        steps: list[Callable[[], None]] = [
            lambda: stop_process(self.gateway),
            lambda: stop_process(self.operator),
            lambda: self.runner.stop() if self.runner is not None else None,
            lambda: self.kube.stop() if self.kube is not None else None,
            lambda: self.redis.close() if self.redis is not None else None,
        ]
        for step in steps:
            try:
                step()
            except BaseException as e:  # keep tearing down; report at the end
                errors.append(e)
        self.gateway = self.operator = None
        self.gateway_url = None
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> LocalPlatform:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- pieces ---------------------------------------------------------------------------------------

    def _write_kubeconfig(self) -> None:
        # JSON is YAML: no YAML writer needed.
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kvfleet-local", "cluster": {"server": self.kube_url}}],
            "users": [{"name": "kvfleet-local", "user": {}}],
            "contexts": [
                {
                    "name": "kvfleet-local",
                    "context": {"cluster": "kvfleet-local", "user": "kvfleet-local", "namespace": "default"},
                }
            ],
            "current-context": "kvfleet-local",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=2) + "\n")

    def _pod_env(self) -> dict[str, str]:
        """What the pod runner adds to every container (before the template's own env). The OTLP endpoint
        itself comes from the pod template, as in a cluster (the operator's ``--otlp-endpoint``)."""
        return dict(OTEL_FAST_EXPORT) if self.otlp_endpoint else {}

    def _secrets_env(self) -> dict[str, str]:
        """The operator's and the gateway's credentials, as the chart gives them: in the environment, never on a
        command line, which every local user can read (``ps``, /proc/PID/cmdline)."""
        return {
            "KVFLEET_REDIS_URL": self.redis_url,
            "KVFLEET_ADMIN_TOKEN": self.admin_token,
            "KVFLEET_REPLICA_KEY_ROOT": self.replica_key_root,
        }

    def operator_metrics(self) -> str:
        """The operator's Prometheus metrics (its ``--metrics-port``), as text."""
        return httpx.get(f"http://127.0.0.1:{self.operator_metrics_port}/metrics", timeout=30).text

    def _start_operator(self) -> None:
        health_port = free_port()
        self.operator_metrics_port = free_port()
        cmd = [
            sys.executable, "-m", "kvfleet_cli.main", "operator",
            f"--server={self.kube_url}",
            f"--operator-namespace={OPERATOR_NAMESPACE}",
            f"--engine-image={ENGINE_IMAGE}",
            "--standalone",
            f"--liveness=http://127.0.0.1:{health_port}/healthz",
            f"--idle-check-seconds={self.operator_idle_check_s}",
            "--resync-seconds=5",
            f"--autoscale-seconds={self.operator_autoscale_s}",
            f"--metrics-port={self.operator_metrics_port}",
        ]  # fmt: skip
        if self.otlp_endpoint:
            cmd.append(f"--otlp-endpoint={self.otlp_endpoint}")
        env = {**os.environ, **self._secrets_env()}
        with (self.work_dir / "operator.log").open("ab") as out:
            self.operator = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=env,
            )  # fmt: skip

        def healthy() -> bool:
            assert self.operator is not None
            if self.operator.poll() is not None:
                raise RuntimeError(
                    f"the operator exited with {self.operator.returncode}:\n{self.log('operator')}"
                )
            try:
                return httpx.get(f"http://127.0.0.1:{health_port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, STARTUP_TIMEOUT_S, "the operator did not report healthy", interval=0.2)

    def start_gateway(self) -> None:
        """Start ``kvfleet gateway`` against this platform's Redis (the operator's admin token and replica key
        root: it routes to the engines the operator keyed, and sleeps and wakes them with their models' derived
        admin tokens), wait until ``/health`` answers, and set ``gateway_url``."""
        if importlib.util.find_spec("kvfleet_gateway") is None:
            raise RuntimeError("the gateway is not installed: pip install -e '.[gateway]'")
        port = self.gateway_port or free_port()
        cmd = [
            sys.executable, "-m", "kvfleet_cli.main", "gateway",
            "--host", "127.0.0.1",
            "--port", str(port),
            *self.gateway_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self._secrets_env()}
        if self.otlp_endpoint:
            env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint, **OTEL_FAST_EXPORT}
        with (self.work_dir / "gateway.log").open("ab") as out:
            self.gateway = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=env,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert self.gateway is not None
            if self.gateway.poll() is not None:
                raise RuntimeError(
                    f"the gateway exited with {self.gateway.returncode}:\n{self.log('gateway')}"
                )
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, STARTUP_TIMEOUT_S, "the gateway did not report healthy", interval=0.2)
        self.gateway_url = url

    def stop_gateway(self) -> None:
        """Stop the gateway (SIGTERM: it flushes its usage and removes its load record from Redis)."""
        stop_process(self.gateway)
        self.gateway = None
        self.gateway_url = None

    # ---- using it -------------------------------------------------------------------------------------

    def kubectl(self, *args: str, timeout: float = 120.0, input_text: str | None = None) -> str:
        """Run ``kubectl`` against the platform (``input_text`` on its stdin, e.g. for ``apply -f -``); its
        stdout, or RuntimeError with its output."""
        exe = shutil.which("kubectl")
        if exe is None:
            raise RuntimeError("kubectl is not installed")
        proc = subprocess.run(
            [exe, f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.work_dir / 'kube-cache'}", *args],
            capture_output=True,
            text=True,
            input=input_text,
            timeout=timeout,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
            )
        return proc.stdout

    def build_demo_model(self, name: str = DEMO_MODEL_DIR, preset: str = "tiny") -> Path:
        """Write a demo model into the ``kvfleet-models`` claim (``pvc://kvfleet-models/<name>``)."""
        from kvfleet_engine.demo_model import build_demo_model

        out = self.models_root / name
        if (out / "config.json").exists():
            return out
        return build_demo_model(out, arch="llama", preset=preset, seed=0)

    def model_status(self, name: str, namespace: str = "default") -> dict[str, Any]:
        """An InferenceModel's ``status`` ({} while it has none or does not exist)."""
        assert self.kube is not None, "not started"
        obj = self.kube.get(f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/inferencemodels/{name}")
        return (obj or {}).get("status", {}) or {}

    def log(self, component: str) -> str:
        """The tail of ``operator.log`` / ``gateway.log``."""
        path = self.work_dir / f"{component}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


# ---- as a program ---------------------------------------------------------------------------------------


def chat_through_gateway(platform: LocalPlatform, content: str, timeout: float = 120.0) -> httpx.Response:
    """One chat completion of the example model through the gateway with the example tenant's key, once the
    gateway's fleet snapshot (refreshed every 0.5 s) lists the model; retried while it answers 503."""
    assert platform.gateway_url is not None, "the gateway is not running"
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}

    def attempt() -> httpx.Response | None:
        try:
            r = httpx.post(
                f"{platform.gateway_url}/v1/chat/completions",
                headers=headers,
                json={
                    "model": DEMO_MODEL,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 24,
                },
                timeout=timeout,
            )
        except httpx.HTTPError:
            return None
        if r.status_code in (404, 503):  # not in the gateway's snapshot yet / replicas still starting
            return None
        r.raise_for_status()
        return r

    return wait_for(attempt, timeout, f"the gateway did not serve {DEMO_MODEL}", interval=0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvfleet_devkit.local_platform",
        description="kvfleet on this machine: Redis, a Kubernetes API emulator, the operator and local "
        "engine pods (the equivalent of `kvfleet up --with-operator`). Ctrl-C stops everything.",
    )
    p.add_argument(
        "--work-dir", type=Path, default=ROOT / ".kvfleet" / "local", help="logs, kubeconfig, pods"
    )
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="demo model size")
    p.add_argument("--no-examples", action="store_true", help="do not apply the example tenant and model")
    p.add_argument("--with-gateway", action="store_true", help="also start the gateway")
    p.add_argument("--gateway-port", type=int, default=None, help="the gateway's port (default: a free one)")
    p.add_argument(
        "--admin-token", default="local-admin-token", help="admin token of the gateway and engines"
    )
    p.add_argument(
        "--otlp-endpoint", default=None, help="export the gateway's and engines' spans there (OTLP/HTTP)"
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="with the gateway: send one chat request through it with the example tenant's key, then stop",
    )
    args = p.parse_args(argv)
    if args.once and args.no_examples:
        p.error("--once needs the examples (the tenant's key and the model)")
    if not args.no_examples and not EXAMPLES.is_dir():
        p.error(f"{EXAMPLES} not found: the examples come from a source checkout (an editable install of it); "
                "pass --no-examples without one")  # fmt: skip
    with_gateway = args.with_gateway or args.once
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kvfleet.devkit").setLevel(logging.INFO)  # pods starting, exiting, restarting
    marker = args.work_dir / ".kvfleet-local-platform"
    if args.work_dir.exists() and any(args.work_dir.iterdir()):
        if not marker.exists():
            p.error(f"{args.work_dir} is not empty and not a previous local platform's directory")
        shutil.rmtree(args.work_dir)  # a fresh platform: the emulator starts empty
    args.work_dir.mkdir(parents=True, exist_ok=True)
    marker.touch()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # Explicit handlers: a shell that starts this in the background makes it ignore SIGINT otherwise.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    platform = LocalPlatform(
        args.work_dir,
        with_gateway=with_gateway,
        admin_token=args.admin_token,
        gateway_port=args.gateway_port,
        otlp_endpoint=args.otlp_endpoint,
    )
    status = 0
    try:
        platform.start()
        model_dir = platform.build_demo_model(preset=args.preset)
        if not args.no_examples:
            platform.kubectl(
                "apply", "--validate=false", "-f", str(EXAMPLES / "tenant.yaml"), "-f",
                str(EXAMPLES / "local-tiny.yaml"),
            )  # fmt: skip
            print(f"waiting for InferenceModel {DEMO_MODEL} to become Ready (the engine loads the model)...")
            wait_for(
                lambda: platform.model_status(DEMO_MODEL).get("phase") == "Ready",
                600,
                f"{DEMO_MODEL} did not become Ready (see the pod logs)",
                interval=0.5,
            )
        if args.once:
            r = chat_through_gateway(platform, "Tell me about the lighthouse on the hill.")
            body = r.json()
            print(f"POST {platform.gateway_url}/v1/chat/completions (tenant team-a, key {TENANT_KEY}) "
                  f"-> replica {r.headers.get('x-kvfleet-replica')}")  # fmt: skip
            print(f"  -> {body['choices'][0]['message']['content']!r}\n  usage: {body['usage']}", flush=True)
            return 0
        gateway = (
            f"""
Through the gateway, with the example tenant's key (examples/tenant.yaml):
  curl {platform.gateway_url}/v1/chat/completions -H 'Authorization: Bearer {TENANT_KEY}' \\
    -H 'content-type: application/json' \\
    -d '{{"model": "{DEMO_MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 16}}'
  curl -X POST -H 'Authorization: Bearer {platform.admin_token}' {platform.gateway_url}/admin/models/{DEMO_MODEL}/sleep
"""
            if platform.gateway_url
            else "Gateway: not started (--with-gateway).\n"
        )
        print(
            f"""
kvfleet is running locally (work dir {platform.work_dir}).

  export KUBECONFIG={platform.kubeconfig}
  kubectl get im,deployments,pods               # apply needs --validate=false (the emulator has no OpenAPI)
  kubectl scale im/{DEMO_MODEL} --replicas=2
  redis-cli -u {platform.redis_url} keys 'kvf:*'
  tail -f {platform.work_dir}/pods/default/*/container.log {platform.work_dir}/operator.log

Engine replicas announce their URL in Redis (kvf:replica:*, field base_url); e.g.
  curl $(redis-cli -u {platform.redis_url} --scan --pattern 'kvf:replica:{DEMO_MODEL}-*' | grep -v ':blocks$' \\
      | head -1 | xargs -I{{}} redis-cli -u {platform.redis_url} hget {{}} base_url)/v1/chat/completions \\
    -H 'content-type: application/json' \\
    -d '{{"model": "{DEMO_MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 16}}'
{gateway}Model weights: {model_dir} (pvc://{MODELS_CLAIM}/{model_dir.name}).   Ctrl-C stops everything.
""",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping...", flush=True)
        platform.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
