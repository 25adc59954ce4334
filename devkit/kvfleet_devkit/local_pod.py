"""One Pod of the pod runner: a local process tree started from the pod template's single container, probed,
restarted after the kubelet's back-off, and reported through the API as a kubelet would (see ``podrunner``).

A `LocalPod` reads its node's settings from its `PodHost` (the `podrunner.PodRunner` that created it); the
protocol keeps this module from importing the runner's.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvfleet_devkit.kube_api import Api, pod_path
from kvfleet_devkit.pod_translation import (
    POD_IP,
    ConfigError,
    Probe,
    expand_vars,
    field_ref,
    merge_condition_times,
    now_rfc3339,
    rewrite_args,
    rewrite_env_value,
    status_equal,
)
from kvfleet_devkit.processes import free_port, kill_group

log = logging.getLogger("kvfleet.devkit.podrunner")

CONTAINER_ID_SCHEME = "local://"  # containerStatuses[].containerID = local://<pid of the main process>
CRASH_BACKOFF_MAX_S = 300.0
CRASH_BACKOFF_RESET_S = 600.0  # a container that ran this long starts its back-off afresh


class PodHost(Protocol):
    """What a pod reads from the runner that created it: the node's settings, and where it records its
    process groups and its failures."""

    server: str
    work_dir: Path
    pvc_root: Path
    commands: Mapping[str, tuple[str, ...]]
    extra_env: Mapping[str, str]
    tick_s: float
    probe_period_s: float | None
    crash_backoff_s: float
    max_grace_s: float
    errors: list[str]

    def remember_group(self, pgid: int) -> None: ...


@dataclass(slots=True)
class ContainerPlan:
    """A container resolved for this machine: what to exec, where, with what."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


class LocalPod:
    """One Pod = one local process (its container), run by a thread that starts, probes, restarts and
    reports it. Created by `PodRunner` after the Pod object exists in the API."""

    def __init__(self, runner: PodHost, pod: dict[str, Any], template_hash_: str) -> None:
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
        self.runner.remember_group(self.proc.pid)
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
