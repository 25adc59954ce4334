"""A development harness, not a product component: a stand-in kubelet + Deployment controller for the local
platform (``local_platform``; the e2e tests and ``kvfleet up --with-operator``).

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
- ``command[0]`` is looked up in ``commands`` (``kvfleet`` -> this interpreter's ``-m kvfleet_cli.main``),
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

Modules: this one is the Deployment controller and the runner's lifecycle; ``local_pod`` is one pod (the
kubelet's part); ``pod_translation`` holds the pure rules both follow; ``kube_api`` the API client.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfleet_devkit.kube_api import Api, deployment_path, pod_path
from kvfleet_devkit.local_pod import LocalPod
from kvfleet_devkit.pod_translation import (
    NODE_NAME,
    TEMPLATE_HASH_LABEL,
    merge_condition_times,
    now_rfc3339,
    pod_name,
    rollout_budget,
    status_equal,
    template_hash,
)
from kvfleet_devkit.processes import group_members, kill_group

log = logging.getLogger("kvfleet.devkit.podrunner")

DEFAULT_COMMANDS: dict[str, tuple[str, ...]] = {"kvfleet": (sys.executable, "-m", "kvfleet_cli.main")}


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

    def remember_group(self, pgid: int) -> None:
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
        pod_objects = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p for p in api.list("/api/v1/pods")
        }
        existing = set(pod_objects)
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
            self._reconcile_deployment(api, fleet, dep, deletion_costs(pod_objects.values()))
            self._write_deployment_status(api, fleet, dep)

    def _retire(self, pod: LocalPod) -> None:
        pod.stop()
        self._leaving.append(pod)

    def _reconcile_deployment(
        self, api: Api, fleet: Fleet, dep: dict[str, Any], costs: Mapping[tuple[str, str], int]
    ) -> None:
        """One step of the Deployment controller: scale, then roll old pods out within the budget.
        ``costs``: each pod's ``controller.kubernetes.io/pod-deletion-cost`` (absent: 0)."""
        spec = dep["spec"]
        desired = int(spec.get("replicas", 1))
        template = spec.get("template") or {}
        current = template_hash(template)
        surge, unavailable = rollout_budget(dep)
        with self._lock:
            new = [p for p in fleet.pods if p.hash == current]
            old = [p for p in fleet.pods if p.hash != current]
            # Scale down as a ReplicaSet ranks pods: not ready first, then the lowest deletion cost, then the
            # most restarted, then the newest.
            extra = len(new) - desired
            if extra > 0:
                ranked = sorted(
                    new,
                    key=lambda p: (
                        p.reported_ready,
                        costs.get((p.namespace, p.name), 0),
                        -p.restart_count,
                        -p.created,
                    ),
                )
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


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def deletion_costs(pods: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    """(namespace, name) -> the pod's deletion cost annotation, where it has a valid one."""
    costs: dict[tuple[str, str], int] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(DELETION_COST)
        try:
            costs[meta["namespace"], meta["name"]] = int(raw)
        except (TypeError, ValueError, KeyError):
            continue
    return costs
