"""TEST HARNESS, NOT PRODUCT: a stand-in kubelet + Deployment controller for the local e2e platform.

On one machine without a cluster, the Kubernetes API is KMock's emulator, which stores objects but runs no
controllers. `PodRunner` plays the missing pieces for the Deployments the operator creates:

- the **Deployment controller**: for each selected Deployment it keeps ``spec.replicas`` Pods whose
  template matches the current one (rolling replacement within ``maxSurge`` / ``maxUnavailable``), removes
  the extra ones on scale-down (not-ready first, then the most restarted, then the newest), and writes the Deployment's ``status``
  (replicas, updated / ready / available counts, ``observedGeneration``, Available and Progressing
  conditions) from what its Pods last reported;
- the **kubelet**: each Pod is one local process tree started from the pod template's single container
  (``command`` + ``args`` + ``env``; the image is ignored), with the pod's status (phase, ``podIP``,
  conditions, ``containerStatuses`` with ``restartCount``, ``state`` / ``lastState`` and ``ready``)
  reported through the API. Startup, readiness and liveness probes run as the template says; a process
  that exits is restarted (``restartPolicy: Always``) after the kubelet's back-off (none for the first
  crash, then 10 s doubling up to 300 s, shown as ``waiting: CrashLoopBackOff``);
- **garbage collection**: the emulator does not cascade deletes, so when a Deployment disappears its Pods'
  processes are stopped and the Pod objects deleted here. A Pod deleted through the API stops its process
  and gets replaced, as in a cluster.

Translation from pod to process (the only places where this differs from a node):

- ``status.podIP`` is 127.0.0.1; each container port gets a free local port. ``--port <containerPort>``
  in the args, ``--host 0.0.0.0`` (bound to 127.0.0.1 instead), and ``127.0.0.1:<containerPort>`` in
  env values after ``$(VAR)`` expansion are rewritten accordingly; probes use the local port.
- Volumes: a ``persistentVolumeClaim`` is the directory ``<pvc_root>/<claimName>``, a ``configMap`` or
  ``secret`` is written out into the pod's directory, an ``emptyDir`` is a directory in the pod's directory (a memory
  ``emptyDir`` at ``/dev/shm`` is the host's ``/dev/shm``). Any mount path in args or env values is
  rewritten to its local directory, so ``--model /models/demo-llama-tiny`` with a claim mounted at
  ``/models`` becomes ``--model <pvc_root>/kvfleet-models/demo-llama-tiny``.
- ``command[0]`` is looked up in ``commands`` (``kvfleet`` -> this interpreter's ``-m kvfleet_common.cli``),
  else on ``PATH``. The process inherits this process's environment minus ``KVFLEET_*`` (so it finds the
  same virtualenv), then the runner's ``extra_env`` (what a node would add to every container; the harness
  uses it for test-only settings such as a faster trace export), then the container's ``env`` (``value`` with ``$(VAR)`` expansion, ``fieldRef``,
  ``secretKeyRef``, ``configMapKeyRef``) and ``envFrom``.
- Each container runs in its own process group (``start_new_session``); when its main process exits
  the rest of the group is killed, as a container runtime tears down a container. Stopping a pod sends
  SIGTERM to the main process, waits the pod's grace period (capped by ``max_grace_s``), then SIGKILLs
  the group. `PodRunner.stop` stops every pod this way and checks that none of their processes is left.

Not emulated: init containers, multi-container pods (such pods stay Pending with a waiting reason), node
scheduling and resources, the ReplicaSet objects (Pods are owned by their Deployment directly and carry
the ``pod-template-hash`` label), ``progressDeadlineSeconds``, and security contexts.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("kvfleet.e2e.podrunner")

POD_IP = "127.0.0.1"
NODE_NAME = "local"
TEMPLATE_HASH_LABEL = "pod-template-hash"
CONTAINER_ID_SCHEME = "local://"  # containerStatuses[].containerID = local://<pid of the main process>
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what Kubernetes uses for generated name suffixes
CRASH_BACKOFF_MAX_S = 300.0
CRASH_BACKOFF_RESET_S = 600.0  # a container that ran this long starts its back-off afresh
DEFAULT_COMMANDS: dict[str, tuple[str, ...]] = {"kvfleet": (sys.executable, "-m", "kvfleet_common.cli")}
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def now_rfc3339() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- pure helpers ------------------------------------------------------------------------------------


def template_hash(template: Mapping[str, Any]) -> str:
    """A stable short hash of a pod template (the ``pod-template-hash`` label; part of every pod name)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    n = int.from_bytes(digest[:8], "big")
    out = []
    for _ in range(10):
        n, i = divmod(n, len(NAME_ALPHABET))
        out.append(NAME_ALPHABET[i])
    return "".join(out)


def pod_name(deployment: str, hash_: str) -> str:
    return f"{deployment}-{hash_}-{''.join(secrets.choice(NAME_ALPHABET) for _ in range(5))}"


def expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known variables are replaced, unknown references stay as they are,
    and ``$$`` is an escaped ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, value)


def resolve_int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    """``maxSurge`` / ``maxUnavailable``: an int, or a percentage of ``total`` (surge rounds up,
    unavailable rounds down, as the Deployment controller does)."""
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        exact = total * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def rollout_budget(deployment: Mapping[str, Any]) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) of a Deployment; both zero is impossible (unavailable becomes 1)."""
    spec = deployment.get("spec", {})
    desired = int(spec.get("replicas", 1))
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return 0, max(desired, 1)
    rolling = strategy.get("rollingUpdate") or {}
    surge = resolve_int_or_percent(rolling.get("maxSurge", "25%"), desired, round_up=True)
    unavailable = resolve_int_or_percent(rolling.get("maxUnavailable", "25%"), desired, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def rewrite_args(args: Sequence[str], ports: Mapping[int, int], mounts: Mapping[str, str]) -> list[str]:
    """The container's args for a local process: ``--port <containerPort>`` -> the local port,
    ``--host 0.0.0.0`` -> 127.0.0.1, mount paths -> local directories."""
    out: list[str] = []
    previous = ""
    for arg in args:
        if previous == "--port" and arg.isdigit() and int(arg) in ports:
            arg = str(ports[int(arg)])
        elif arg.startswith("--port=") and arg[7:].isdigit() and int(arg[7:]) in ports:
            arg = f"--port={ports[int(arg[7:])]}"
        elif previous == "--host" and arg in ("0.0.0.0", "::"):
            arg = POD_IP
        elif arg in ("--host=0.0.0.0", "--host=::"):
            arg = f"--host={POD_IP}"
        else:
            arg = rewrite_paths(arg, mounts)
        out.append(arg)
        previous = arg
    return out


def rewrite_env_value(value: str, ports: Mapping[int, int], mounts: Mapping[str, str]) -> str:
    for container_port, local in ports.items():
        value = re.sub(rf"{re.escape(POD_IP)}:{container_port}(?!\d)", f"{POD_IP}:{local}", value)
    return rewrite_paths(value, mounts)


def rewrite_paths(value: str, mounts: Mapping[str, str]) -> str:
    """Replace a mount path (longest first) where it starts ``value`` or follows ``=`` / ``:``, at a path
    boundary (``/models`` matches ``/models`` and ``/models/x``, never ``/modelsx``)."""
    for mount in sorted(mounts, key=len, reverse=True):
        pattern = rf"(^|(?<=[=:])){re.escape(mount.rstrip('/'))}(?=/|$|:)"
        replaced = re.sub(pattern, lambda _m, local=mounts[mount]: local, value)
        if replaced != value:
            return replaced
    return value


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's ``fieldRef.fieldPath`` for a local pod."""
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": NODE_NAME,
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", "default"),
        "status.podIP": POD_IP,
        "status.podIPs": POD_IP,
        "status.hostIP": POD_IP,
        "status.hostIPs": POD_IP,
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"unsupported fieldRef {path!r}")


def status_equal(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal apart from timestamps (which would otherwise make every report a change)."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("lastTransitionTime", "lastUpdateTime")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return a is not None and strip(dict(a)) == strip(dict(b))


def merge_condition_times(previous: Sequence[Mapping[str, Any]], current: list[dict[str, Any]]) -> None:
    """Keep ``lastTransitionTime`` where a condition's status did not flip (in place)."""
    before = {c.get("type"): c for c in previous}
    for cond in current:
        old = before.get(cond["type"])
        if old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime"):
            cond["lastTransitionTime"] = old["lastTransitionTime"]


# ---- processes -----------------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``, from /proc."""
    members: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class ConfigError(Exception):
    """The container cannot be started as specified (missing Secret key, unsupported field, ...): the
    kubelet's CreateContainerConfigError."""


# ---- API access ----------------------------------------------------------------------------------------


class Api:
    """Plain JSON over HTTP against the API server (no auth: the local emulator). One per thread."""

    def __init__(self, server: str, timeout: float = 10.0) -> None:
        self.client = httpx.Client(base_url=server.rstrip("/"), timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def get(self, path: str) -> dict[str, Any] | None:
        resp = self.client.get(path)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def list(self, path: str) -> list[dict[str, Any]]:
        return (self.get(path) or {}).get("items", []) or []

    def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        resp = self.client.post(path, json=obj)
        resp.raise_for_status()
        return resp.json()

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> bool:
        """False when the object is gone."""
        resp = self.client.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})
        if resp.status_code == 404:
            return False
        resp.raise_for_status()
        return True

    def delete(self, path: str) -> None:
        resp = self.client.delete(path)
        if resp.status_code != 404:
            resp.raise_for_status()


def pod_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"


# ---- one pod ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Probe:
    """A container probe with its period scaled to ``period`` while keeping its failure window
    (``failureThreshold × periodSeconds``) in seconds, so a fast-polling harness gives up no sooner."""

    kind: str  # startup | readiness | liveness
    spec: dict[str, Any]
    period: float
    failure_threshold: int
    timeout: float
    next_at: float = 0.0
    failures: int = 0

    @classmethod
    def from_spec(cls, kind: str, spec: dict[str, Any] | None, period: float | None) -> Probe | None:
        if not spec:
            return None
        template_period = float(spec.get("periodSeconds", 10))
        threshold = int(spec.get("failureThreshold", 3))
        use_period = template_period if period is None else min(period, template_period)
        window = threshold * template_period
        return cls(
            kind=kind,
            spec=spec,
            period=use_period,
            failure_threshold=max(1, math.ceil(window / use_period)),
            timeout=float(spec.get("timeoutSeconds", 1)),
        )


@dataclass(slots=True)
class ContainerPlan:
    """A container resolved for this machine: what to exec, where, with what."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


class LocalPod:
    """One Pod = one local process (its container), run by a thread that starts, probes, restarts and
    reports it. Created by `PodRunner` after the Pod object exists in the API."""

    def __init__(self, runner: PodRunner, pod: dict[str, Any], template_hash_: str) -> None:
        self.runner = runner
        self.pod = pod
        self.name: str = pod["metadata"]["name"]
        self.namespace: str = pod["metadata"]["namespace"]
        self.hash = template_hash_
        self.created = time.monotonic()
        self.dir = runner.work_dir / "pods" / self.namespace / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "container.log"
        spec = pod["spec"]
        self.containers = spec.get("containers", [])
        self.container = self.containers[0] if self.containers else {}
        self.grace_s = min(float(spec.get("terminationGracePeriodSeconds", 30)), runner.max_grace_s)
        # container port -> local port, fixed for the pod's life (a pod keeps its IP:port across restarts)
        self.port_map = {int(p["containerPort"]): free_port() for p in self.container.get("ports", [])}
        self.named_ports = {
            p.get("name", str(p["containerPort"])): self.port_map[int(p["containerPort"])]
            for p in self.container.get("ports", [])
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgids: list[int] = []
        self.restart_count = 0
        self.started_once = False  # the startup probe succeeded (or there is none) in this run
        self.ready = False
        self.reported_ready = False  # what the API last heard: the Deployment status follows this
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.started_at: float | None = None
        self.start_time = now_rfc3339()
        self.next_start = 0.0
        self.backoff = 0.0
        self._probes: list[Probe] = []
        self._last_status: dict[str, Any] | None = None
        self._conditions: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._delete_object = True
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"pod-{self.name}", daemon=True)

    # -- control (called by the runner) --

    def start(self) -> LocalPod:
        self._thread.start()
        return self

    def stop(self, *, delete_object: bool = True) -> None:
        """Ask the pod to terminate (asynchronously); ``finished`` is set once its processes are gone."""
        self._delete_object = delete_object
        self.ready = False
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # -- the pod's thread --

    def _main(self) -> None:
        api = Api(self.runner.server)
        try:
            if len(self.containers) != 1 or self.pod["spec"].get("initContainers"):
                self.state = {
                    "waiting": {
                        "reason": "UnsupportedByPodRunner",
                        "message": "the local pod runner runs pods with exactly one container and no init "
                        "containers",
                    }
                }
                self._report(api)
                self._stop.wait()
                return
            while not self._stop.is_set():
                self._step(api)
                self._report(api)
                self._stop.wait(self.runner.tick_s)
        except Exception as e:  # a harness bug: surfaced through `errors`, and no process left behind
            log.exception("pod %s/%s failed", self.namespace, self.name)
            self.runner.errors.append(f"pod {self.namespace}/{self.name}: {e!r}")
        finally:
            self._terminate()
            self.ready = False
            try:
                if self._delete_object:
                    with contextlib.suppress(httpx.HTTPError):
                        api.delete(pod_path(self.namespace, self.name))
            finally:
                api.close()
                self.finished.set()

    def _step(self, api: Api) -> None:
        now = time.monotonic()
        if self.proc is None:
            if now < self.next_start:
                return
            try:
                plan = self._plan(api)
            except (ConfigError, httpx.HTTPError) as e:
                self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                self.next_start = now + 1.0
                return
            self._launch(plan)
            return
        rc = self.proc.poll()
        if rc is not None:
            self._exited(rc)
            return
        self._run_probes(now)

    def _plan(self, api: Api) -> ContainerPlan:
        c = self.container
        mounts = self._mounts(api)
        env = self._env(api, mounts)
        command = [expand_vars(a, env) for a in c.get("command") or []]
        if not command:
            raise ConfigError("the container has no command (image entrypoints are not known locally)")
        exe = command[0]
        if exe in self.runner.commands:
            prefix = list(self.runner.commands[exe])
        else:
            found = shutil.which(exe)
            if found is None:
                raise ConfigError(f"executable {exe!r} not found")
            prefix = [found]
        argv = prefix + [rewrite_args([a], self.port_map, mounts)[0] for a in command[1:]]
        args = [expand_vars(a, env) for a in c.get("args") or []]
        argv += rewrite_args(args, self.port_map, mounts)
        return ContainerPlan(argv=argv, env=env, cwd=self.dir)

    def _mounts(self, api: Api) -> dict[str, str]:
        """mountPath -> local directory for the container's volume mounts."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        mounts: dict[str, str] = {}
        for m in self.container.get("volumeMounts", []):
            volume = volumes.get(m["name"])
            if volume is None:
                raise ConfigError(f"volume mount {m['name']!r} names no volume")
            path = m["mountPath"]
            if "persistentVolumeClaim" in volume:
                local = self.runner.pvc_root / volume["persistentVolumeClaim"]["claimName"]
                if not local.is_dir():
                    raise ConfigError(f"no local directory {local} for claim of volume {m['name']!r}")
            elif "configMap" in volume:
                local = self.dir / "volumes" / m["name"]
                self._write_config_map(api, volume["configMap"], local)
            elif "secret" in volume:
                local = self.dir / "volumes" / m["name"]
                self._write_secret(api, volume["secret"], local)
            elif "emptyDir" in volume:
                if path == "/dev/shm" and (volume["emptyDir"] or {}).get("medium") == "Memory":
                    continue  # the host's shared memory is what the processes use anyway
                local = self.dir / "volumes" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
            else:
                raise ConfigError(f"volume {m['name']!r}: unsupported volume type")
            if m.get("subPath"):
                local = local / m["subPath"]
            mounts[path] = str(local)
        return mounts

    def _write_config_map(self, api: Api, ref: Mapping[str, Any], out: Path) -> None:
        cm = api.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{ref['name']}")
        if cm is None:
            if ref.get("optional"):
                out.mkdir(parents=True, exist_ok=True)
                return
            raise ConfigError(f'configmap "{ref["name"]}" not found')
        out.mkdir(parents=True, exist_ok=True)
        for key, value in (cm.get("data") or {}).items():
            (out / key).write_text(value)

    def _write_secret(self, api: Api, ref: Mapping[str, Any], out: Path) -> None:
        secret = api.get(f"/api/v1/namespaces/{self.namespace}/secrets/{ref['secretName']}")
        if secret is None:
            raise ConfigError(f'secret "{ref["secretName"]}" not found')
        out.mkdir(parents=True, exist_ok=True)
        for key in {**(secret.get("data") or {}), **(secret.get("stringData") or {})}:
            (out / key).write_bytes(self._secret_value(secret, key))

    @staticmethod
    def _secret_value(secret: Mapping[str, Any], key: str) -> bytes:
        # ``stringData`` is converted to ``data`` by a real API server, not by the emulator.
        if key in (secret.get("data") or {}):
            return base64.b64decode(secret["data"][key])
        return str((secret.get("stringData") or {})[key]).encode()

    def _lookup(self, api: Api, kind: str, ref: Mapping[str, Any]) -> str | None:
        plural = "secrets" if kind == "secret" else "configmaps"
        obj = api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{ref['name']}")
        key = ref["key"]
        if obj is None:
            if ref.get("optional"):
                return None
            raise ConfigError(f'{kind} "{ref["name"]}" not found')
        if kind == "secret":
            if key in (obj.get("data") or {}) or key in (obj.get("stringData") or {}):
                return self._secret_value(obj, key).decode()
        elif key in (obj.get("data") or {}):
            return obj["data"][key]
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {key} in {kind} {self.namespace}/{ref['name']}")

    def _env(self, api: Api, mounts: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
        env.update(self.runner.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        env["HOSTNAME"] = self.name
        declared: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            prefix = source.get("prefix", "")
            for kind, key in (("secret", "secretRef"), ("configmap", "configMapRef")):
                if key not in source:
                    continue
                plural = "secrets" if kind == "secret" else "configmaps"
                obj = api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{source[key]['name']}")
                if obj is None:
                    if source[key].get("optional"):
                        continue
                    raise ConfigError(f'{kind} "{source[key]["name"]}" not found')
                names = {**(obj.get("data") or {}), **(obj.get("stringData") or {})}
                for name in names:
                    value = self._secret_value(obj, name).decode() if kind == "secret" else obj["data"][name]
                    declared[prefix + name] = value
        for var in self.container.get("env", []):
            name = var["name"]
            if "value" in var:
                value: str | None = expand_vars(str(var["value"]), declared)
            else:
                source = var.get("valueFrom") or {}
                if "fieldRef" in source:
                    value = field_ref(self.pod, source["fieldRef"]["fieldPath"])
                elif "secretKeyRef" in source:
                    value = self._lookup(api, "secret", source["secretKeyRef"])
                elif "configMapKeyRef" in source:
                    value = self._lookup(api, "configmap", source["configMapKeyRef"])
                elif "resourceFieldRef" in source:
                    value = "0"
                else:
                    value = ""
            if value is not None:
                declared[name] = value
        for name, value in declared.items():
            env[name] = rewrite_env_value(value, self.port_map, mounts)
        return env

    def _launch(self, plan: ContainerPlan) -> None:
        with self.log_path.open("ab") as logf:
            logf.write(f"---- {now_rfc3339()} start #{self.restart_count}: {' '.join(plan.argv)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                plan.argv,
                env=plan.env,
                cwd=plan.cwd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the "container" we tear down as a whole
            )
        self.pgids.append(self.proc.pid)
        self.runner._remember_group(self.proc.pid)
        self.started_at = time.monotonic()
        self.state = {"running": {"startedAt": now_rfc3339()}}
        container = self.container
        self._probes = [
            p
            for p in (
                Probe.from_spec("startup", container.get("startupProbe"), self.runner.probe_period_s),
                Probe.from_spec("readiness", container.get("readinessProbe"), self.runner.probe_period_s),
                Probe.from_spec("liveness", container.get("livenessProbe"), self.runner.probe_period_s),
            )
            if p is not None
        ]
        self.started_once = not any(p.kind == "startup" for p in self._probes)
        # Without a readiness probe a running container is ready (after startup, if there is a probe).
        self.ready = self.started_once and not any(p.kind == "readiness" for p in self._probes)
        now = time.monotonic()
        for probe in self._probes:
            probe.next_at = now + float(probe.spec.get("initialDelaySeconds", 0))
        log.info(
            "pod %s/%s: started pid %d (restart %d)",
            self.namespace,
            self.name,
            self.proc.pid,
            self.restart_count,
        )

    def _exited(self, rc: int) -> None:
        """The main process ended: tear the container down, record why, schedule the restart."""
        assert self.proc is not None and self.started_at is not None
        kill_group(self.proc.pid)
        ran_for = time.monotonic() - self.started_at
        exit_code = rc if rc >= 0 else 128 - rc
        self.last_state = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if rc == 0 else "Error",
                "startedAt": self.state.get("running", {}).get("startedAt", now_rfc3339()),
                "finishedAt": now_rfc3339(),
                "containerID": f"{CONTAINER_ID_SCHEME}{self.proc.pid}",
                **({"signal": -rc} if rc < 0 else {}),
            }
        }
        log.info(
            "pod %s/%s: pid %d exited with %d after %.1f s",
            self.namespace, self.name, self.proc.pid, exit_code, ran_for,
        )  # fmt: skip
        self.proc = None
        self.ready = False
        self.restart_count += 1
        # The kubelet restarts the first crash at once and backs off the following ones, unless the
        # container had been running long enough for its back-off to reset.
        if ran_for >= CRASH_BACKOFF_RESET_S:
            self.backoff = 0.0
        delay = self.backoff
        if self.backoff == 0:
            self.backoff = self.runner.crash_backoff_s
        else:
            self.backoff = min(2 * self.backoff, CRASH_BACKOFF_MAX_S)
        self.next_start = time.monotonic() + delay
        if delay > 0:
            self.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:.0f}s restarting failed container="
                    f"{self.container.get('name', '')} pod={self.name}",
                }
            }
        else:
            self.state = {"waiting": {"reason": "ContainerCreating"}}

    def _run_probes(self, now: float) -> None:
        for probe in self._probes:
            if probe.kind == "startup" and self.started_once:
                continue
            if probe.kind != "startup" and not self.started_once:
                continue
            if now < probe.next_at:
                continue
            probe.next_at = now + probe.period
            ok = self._probe_once(probe)
            if ok:
                probe.failures = 0
                if probe.kind == "startup":
                    self.started_once = True
                    if not any(p.kind == "readiness" for p in self._probes):
                        self.ready = True
                elif probe.kind == "readiness":
                    self.ready = True
                continue
            probe.failures += 1
            if probe.kind == "readiness" and probe.failures >= probe.failure_threshold:
                self.ready = False
            elif probe.kind in ("startup", "liveness") and probe.failures >= probe.failure_threshold:
                log.warning(
                    "pod %s/%s: %s probe failed %d times, restarting",
                    self.namespace, self.name, probe.kind, probe.failures,
                )  # fmt: skip
                self._kill_for_restart()
                return

    def _kill_for_restart(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()
        self._exited(self.proc.returncode)

    def _probe_once(self, probe: Probe) -> bool:
        spec = probe.spec
        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                port = self._local_port(get.get("port"))
                scheme = str(get.get("scheme", "HTTP")).lower()
                url = f"{scheme}://{POD_IP}:{port}{get.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
                resp = httpx.get(url, timeout=probe.timeout, headers=headers, verify=False)
                return 200 <= resp.status_code < 400
            if "tcpSocket" in spec:
                port = self._local_port(spec["tcpSocket"].get("port"))
                with socket.create_connection((POD_IP, port), timeout=probe.timeout):
                    return True
            if "exec" in spec:
                done = subprocess.run(
                    spec["exec"]["command"],
                    timeout=probe.timeout,
                    capture_output=True,
                    cwd=self.dir,
                    check=False,
                )
                return done.returncode == 0
        except (httpx.HTTPError, OSError, subprocess.TimeoutExpired, ConfigError):
            return False
        return False

    def _local_port(self, port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return self.port_map.get(int(port), int(port))
        if port in self.named_ports:
            return self.named_ports[port]
        raise ConfigError(f"probe names an unknown port {port!r}")

    def _terminate(self) -> None:
        """SIGTERM the main process, wait the grace period, then SIGKILL the whole group (and every group
        this pod ever started, in case a teardown was missed)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "pod %s/%s: pid %d ignored SIGTERM for %.0f s, killing",
                    self.namespace, self.name, proc.pid, self.grace_s,
                )  # fmt: skip
        for pgid in self.pgids:
            kill_group(pgid)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.proc = None

    # -- status reporting --

    def status(self) -> dict[str, Any]:
        running = self.proc is not None
        container = self.container
        cstatus: dict[str, Any] = {
            "name": container.get("name", "container"),
            "image": container.get("image", ""),
            "imageID": "",
            "ready": bool(self.ready),
            "started": bool(running and self.started_once),
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if running:
            cstatus["containerID"] = f"{CONTAINER_ID_SCHEME}{self.proc.pid}"  # type: ignore[union-attr]
        ready = "True" if self.ready else "False"
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ]
        for cond in conditions:
            cond["lastTransitionTime"] = now_rfc3339()
        merge_condition_times(self._conditions, conditions)
        self._conditions = conditions
        ever_started = running or self.restart_count > 0
        return {
            "phase": "Running" if ever_started else "Pending",
            "podIP": POD_IP,
            "podIPs": [{"ip": POD_IP}],
            "hostIP": POD_IP,
            "startTime": self.start_time,
            "qosClass": "BestEffort",
            "conditions": conditions,
            "containerStatuses": [cstatus],
        }

    def _report(self, api: Api) -> None:
        status = self.status()
        if status_equal(self._last_status, status):
            return
        ready = self.ready
        try:
            if not api.merge_patch(pod_path(self.namespace, self.name) + "/status", {"status": status}):
                # Deleted through the API (kubectl delete pod): a kubelet stops the pod's containers.
                log.info("pod %s/%s was deleted, stopping it", self.namespace, self.name)
                self.stop(delete_object=False)
                return
        except httpx.HTTPError as e:
            log.warning("pod %s/%s: status update failed: %s", self.namespace, self.name, e)
            return
        self._last_status = status
        self.reported_ready = ready


# ---- the runner --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Fleet:
    """A Deployment's local pods and the status last written for it."""

    namespace: str
    name: str
    pods: list[LocalPod] = field(default_factory=list)
    last_status: dict[str, Any] | None = None


class PodRunner:
    """Runs the Deployments selected by ``label`` (default: those an InferenceModel owns) as local
    processes. ``start()`` returns at once; ``stop()`` stops every process and deletes their Pods.

    ``pvc_root``: directory holding one directory per PersistentVolumeClaim name. ``work_dir``: pod
    directories (logs under ``pods/<namespace>/<pod>/container.log``). ``probe_period_s``: poll probes at
    most this often (failure windows kept). ``max_grace_s``: cap on a pod's termination grace period.
    ``extra_env``: variables every container gets before its own ``env`` (which wins on a conflict).
    """

    def __init__(
        self,
        server: str,
        *,
        pvc_root: Path,
        work_dir: Path,
        label: str = "kvfleet.io/model",
        commands: Mapping[str, Sequence[str]] | None = None,
        interval_s: float = 0.25,
        tick_s: float = 0.1,
        probe_period_s: float | None = 0.5,
        crash_backoff_s: float = 10.0,
        max_grace_s: float = 30.0,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self.extra_env = dict(extra_env or {})
        self.pvc_root = Path(pvc_root)
        self.work_dir = Path(work_dir)
        self.label = label
        self.commands = {**DEFAULT_COMMANDS, **{k: tuple(v) for k, v in (commands or {}).items()}}
        self.interval_s = interval_s
        self.tick_s = tick_s
        self.probe_period_s = probe_period_s
        self.crash_backoff_s = crash_backoff_s
        self.max_grace_s = max_grace_s
        self._fleets: dict[tuple[str, str], Fleet] = {}
        self._leaving: list[LocalPod] = []  # stopping pods, kept until their processes are gone
        self._groups: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="podrunner", daemon=True)
        self.errors: list[str] = []

    # -- public --

    def start(self) -> PodRunner:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop reconciling, terminate every pod (in parallel), and make sure no process is left."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            pods = [p for fleet in self._fleets.values() for p in fleet.pods] + self._leaving
            self._fleets.clear()
            self._leaving = []
        for pod in pods:
            pod.stop()
        for pod in pods:
            pod.join(timeout)
        for pgid in self.process_groups():
            kill_group(pgid)
        deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to become zombies
        while (left := self.leftover_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            raise RuntimeError(f"processes left after stopping the pod runner: {left}")

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pods(self, namespace: str | None = None, deployment: str | None = None) -> list[LocalPod]:
        """The local pods currently serving (not stopping), optionally of one Deployment."""
        with self._lock:
            return [
                p
                for (ns, name), fleet in self._fleets.items()
                if (namespace is None or ns == namespace) and (deployment is None or name == deployment)
                for p in fleet.pods
            ]

    def process_groups(self) -> set[int]:
        """Every process group (= container run) this runner ever started."""
        with self._lock:
            return set(self._groups)

    def leftover_processes(self) -> dict[int, list[int]]:
        """Process group -> live member pids, for groups this runner started that still have members."""
        out = {}
        for pgid in self.process_groups():
            members = group_members(pgid)
            if members:
                out[pgid] = members
        return out

    # -- internals --

    def _remember_group(self, pgid: int) -> None:
        with self._lock:
            self._groups.add(pgid)

    def _main(self) -> None:
        api = Api(self.server)
        try:
            while not self._stop.is_set():
                try:
                    self._reconcile(api)
                except httpx.HTTPError as e:
                    log.warning("reconcile failed (the API server may be busy): %s", e)
                except Exception as e:  # keep running; surfaced through `errors` for tests
                    log.exception("reconcile failed")
                    self.errors.append(repr(e))
                self._stop.wait(self.interval_s)
        finally:
            api.close()

    def _selected(self, deployment: Mapping[str, Any]) -> bool:
        return self.label in (deployment.get("metadata", {}).get("labels") or {})

    def _reconcile(self, api: Api) -> None:
        existing = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in api.list("/api/v1/pods")}
        deployments = {
            (d["metadata"]["namespace"], d["metadata"]["name"]): d
            for d in api.list("/apis/apps/v1/deployments")
            if self._selected(d) and not d["metadata"].get("deletionTimestamp")
        }
        with self._lock:
            gone = [key for key in self._fleets if key not in deployments]
            for key in gone:  # garbage collection: the Deployment is gone, so are its pods
                fleet = self._fleets.pop(key)
                log.info("deployment %s/%s deleted: stopping %d pod(s)", *key, len(fleet.pods))
                for pod in fleet.pods:
                    self._retire(pod)
            self._leaving = [p for p in self._leaving if not p.finished.is_set()]
        for key, dep in deployments.items():
            with self._lock:
                fleet = self._fleets.setdefault(key, Fleet(*key))
                # A Pod deleted through the API (kubectl delete pod): its kubelet stops it, and the
                # Deployment controller replaces it below.
                for pod in fleet.pods:
                    if (pod.namespace, pod.name) not in existing and not pod.stopping:
                        log.info("pod %s/%s was deleted, stopping it", pod.namespace, pod.name)
                        pod.stop(delete_object=False)
                for pod in [p for p in fleet.pods if p.stopping]:
                    fleet.pods.remove(pod)
                    self._leaving.append(pod)
            self._reconcile_deployment(api, fleet, dep)
            self._write_deployment_status(api, fleet, dep)

    def _retire(self, pod: LocalPod) -> None:
        pod.stop()
        self._leaving.append(pod)

    def _reconcile_deployment(self, api: Api, fleet: Fleet, dep: dict[str, Any]) -> None:
        """One step of the Deployment controller: scale, then roll old pods out within the budget."""
        spec = dep["spec"]
        desired = int(spec.get("replicas", 1))
        template = spec.get("template") or {}
        current = template_hash(template)
        surge, unavailable = rollout_budget(dep)
        with self._lock:
            new = [p for p in fleet.pods if p.hash == current]
            old = [p for p in fleet.pods if p.hash != current]
            # Scale down: not ready first, then the most restarted, then the newest.
            extra = len(new) - desired
            if extra > 0:
                ranked = sorted(new, key=lambda p: (p.reported_ready, -p.restart_count, -p.created))
                for pod in ranked[:extra]:
                    fleet.pods.remove(pod)
                    self._retire(pod)
                    new.remove(pod)
            # Old pods that are not ready cost no availability: replace them at once.
            for pod in [p for p in old if not p.reported_ready]:
                fleet.pods.remove(pod)
                self._retire(pod)
                old.remove(pod)
            # Ready old pods go while enough pods stay available.
            available = sum(1 for p in fleet.pods if p.reported_ready)
            for pod in list(old):
                if available - 1 < desired - unavailable:
                    break
                fleet.pods.remove(pod)
                self._retire(pod)
                old.remove(pod)
                available -= 1
            to_create = desired - len(new)
            if old:
                to_create = min(to_create, desired + surge - len(fleet.pods))
        for _ in range(max(0, to_create)):
            pod = self._create_pod(api, dep, template, current)
            with self._lock:
                fleet.pods.append(pod)

    def _create_pod(self, api: Api, dep: dict[str, Any], template: dict[str, Any], hash_: str) -> LocalPod:
        meta, tmeta = dep["metadata"], template.get("metadata") or {}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name(meta["name"], hash_),
                "namespace": meta["namespace"],
                "labels": {**(tmeta.get("labels") or {}), TEMPLATE_HASH_LABEL: hash_},
                "annotations": dict(tmeta.get("annotations") or {}),
                # In a cluster a ReplicaSet sits in between; nothing here reads the owner's kind.
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta.get("uid", ""),
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {**(template.get("spec") or {}), "nodeName": NODE_NAME},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]},
        }
        created = api.create(pod_path(meta["namespace"]), body)
        log.info("created pod %s/%s", meta["namespace"], created["metadata"]["name"])
        return LocalPod(self, created, hash_).start()

    def _write_deployment_status(self, api: Api, fleet: Fleet, dep: dict[str, Any]) -> None:
        spec = dep["spec"]
        desired = int(spec.get("replicas", 1))
        current = template_hash(spec.get("template") or {})
        _, unavailable = rollout_budget(dep)
        with self._lock:
            pods = list(fleet.pods)
        ready = sum(1 for p in pods if p.reported_ready)
        updated = sum(1 for p in pods if p.hash == current)
        complete = updated == desired == len(pods) and ready == desired
        available_ok = ready >= desired - unavailable
        status: dict[str, Any] = {
            "observedGeneration": int(dep["metadata"].get("generation", 0) or 0),
            "replicas": len(pods),
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, desired - ready),
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if available_ok else "False",
                    "reason": "MinimumReplicasAvailable" if available_ok else "MinimumReplicasUnavailable",
                    "message": "Deployment has minimum availability."
                    if available_ok
                    else "Deployment does not have minimum availability.",
                },
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
                    "message": f'ReplicaSet "{fleet.name}-{current}" '
                    + ("has successfully progressed." if complete else "is progressing."),
                },
            ],
        }
        if status_equal(fleet.last_status, status):
            return
        previous = (fleet.last_status or dep.get("status") or {}).get("conditions", [])
        stamp = now_rfc3339()
        for cond in status["conditions"]:
            cond["lastTransitionTime"] = cond["lastUpdateTime"] = stamp
        merge_condition_times(previous, status["conditions"])
        if api.merge_patch(deployment_path(fleet.namespace, fleet.name) + "/status", {"status": status}):
            fleet.last_status = status
