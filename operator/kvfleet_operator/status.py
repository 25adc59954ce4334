"""Pure status logic: an InferenceModel's status from what its Deployment, pods and replicas (Redis
heartbeats) report, which replicas idle-sleep should put to sleep, and how many replicas the Deployment
should have (`asked_replicas`).

Conditions follow metav1.Condition: ``lastTransitionTime`` changes only when ``status`` flips, so a
status refresh that observes nothing new writes an identical status.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvfleet_common.schemas import Heartbeat
from kvfleet_operator.spec import ModelSpec

# Container waiting reasons that mean a replica will not come up without someone acting.
BROKEN_POD_REASONS = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PodProblem:
    pod: str
    container: str
    reason: str
    message: str


def pod_problems(pods: Iterable[dict[str, Any]]) -> list[PodProblem]:
    """Containers stuck in a broken waiting state (crash loops, image pulls, bad config), and containers
    that died and are not ready again yet: the kubelet restarts a first crash at once (no
    CrashLoopBackOff), so without the second rule a replica lost to a crash or an OOM kill would only
    look like a rollout in progress."""
    problems: list[PodProblem] = []
    for pod in pods:
        status = pod.get("status", {})
        name = pod.get("metadata", {}).get("name", "?")
        for cs in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]:
            waiting = cs.get("state", {}).get("waiting") or {}
            terminated = (cs.get("lastState") or {}).get("terminated") or {}
            if waiting.get("reason") in BROKEN_POD_REASONS:
                problems.append(
                    PodProblem(
                        pod=name,
                        container=cs.get("name", "?"),
                        reason=waiting["reason"],
                        message=waiting.get("message", ""),
                    )
                )
            elif terminated and not cs.get("ready"):
                oom = terminated.get("reason") == "OOMKilled"
                problems.append(
                    PodProblem(
                        pod=name,
                        container=cs.get("name", "?"),
                        reason="OOMKilled" if oom else "ContainerRestarted",
                        message=f"exited with code {terminated.get('exitCode', '?')} "
                        f"({terminated.get('reason', 'unknown')}), restart {cs.get('restartCount', '?')}, "
                        "not ready yet",
                    )
                )
    return problems


def _deployment_condition(deployment: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in (deployment or {}).get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return cond
    return {}


def model_status(
    *,
    desired_replicas: int,
    generation: int,
    served_name: str,
    selector: str,
    deployment: dict[str, Any] | None,
    heartbeats: Sequence[Heartbeat],
    pods: Sequence[dict[str, Any]] = (),
    previous_conditions: Sequence[dict[str, Any]] = (),
    now: datetime,
    cold_starting: bool = False,
) -> dict[str, Any]:
    """The full ``status`` of an InferenceModel whose spec is valid. ``cold_starting``: the autoscaler
    started the first replica of a model scaled to zero for a held request (reported as ``ColdStarting``, not
    as a wake: a sleeping replica shows in the Sleeping condition).

    Precedence of ``phase``: Degraded (something needs a human) > Pending (no Deployment yet) >
    Progressing (a rollout or scale is under way) > Sleeping (every live replica sleeps) > ScaledToZero
    > Ready."""
    dep_status = (deployment or {}).get("status", {}) or {}
    replicas = int(dep_status.get("replicas", 0) or 0)
    ready = int(dep_status.get("readyReplicas", 0) or 0)
    updated = int(dep_status.get("updatedReplicas", 0) or 0)
    dep_generation = int((deployment or {}).get("metadata", {}).get("generation", 0) or 0)
    dep_observed = int(dep_status.get("observedGeneration", 0) or 0)
    awake = sum(1 for hb in heartbeats if hb.state == "awake")
    sleeping = sum(1 for hb in heartbeats if hb.state == "sleeping")

    progressing_cond = _deployment_condition(deployment, "Progressing")
    failure_cond = _deployment_condition(deployment, "ReplicaFailure")
    problems = pod_problems(pods)

    # Degraded: the Deployment gave up, cannot create pods, or pods are stuck.
    if progressing_cond.get("reason") == "ProgressDeadlineExceeded":
        degraded = Condition(
            "Degraded", True, "ProgressDeadlineExceeded", progressing_cond.get("message", "")
        )
    elif failure_cond.get("status") == "True":
        degraded = Condition(
            "Degraded", True, failure_cond.get("reason") or "ReplicaFailure", failure_cond.get("message", "")
        )
    elif problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        degraded = Condition(
            "Degraded",
            True,
            first.reason,
            f"pod {first.pod} container {first.container}: {first.message}{more}".strip(),
        )
    else:
        degraded = Condition("Degraded", False, "AsExpected", "")

    # Progressing: the Deployment has not yet caught up with the spec.
    if deployment is None:
        progressing = Condition("Progressing", True, "Creating", "creating the Deployment")
    elif dep_observed < dep_generation:
        progressing = Condition(
            "Progressing", True, "Updating", "the Deployment controller has not seen the update yet"
        )
    elif updated < desired_replicas:
        progressing = Condition(
            "Progressing", True, "RollingOut", f"{updated}/{desired_replicas} replicas updated"
        )
    elif replicas > desired_replicas:
        progressing = Condition(
            "Progressing", True, "ScalingDown", f"{replicas} replicas, {desired_replicas} wanted"
        )
    elif ready < desired_replicas:
        progressing = Condition(
            "Progressing",
            True,
            "ColdStarting" if cold_starting and not ready else "ReplicasStarting",
            f"{ready}/{desired_replicas} replicas ready",
        )
    else:
        progressing = Condition("Progressing", False, "Complete", f"{desired_replicas} replicas up to date")

    if desired_replicas == 0:
        ready_cond = Condition("Ready", False, "ScaledToZero", "no replica is asked for")
    elif ready >= desired_replicas:
        ready_cond = Condition(
            "Ready", True, "AllReplicasReady", f"{ready}/{desired_replicas} replicas ready"
        )
    elif ready > 0:
        ready_cond = Condition(
            "Ready", False, "SomeReplicasReady", f"{ready}/{desired_replicas} replicas ready"
        )
    elif cold_starting:
        ready_cond = Condition(
            "Ready", False, "ColdStarting", "starting the first replica for a held request (scaled to zero)"
        )
    else:
        ready_cond = Condition("Ready", False, "NoReplicasReady", f"0/{desired_replicas} replicas ready")

    if sleeping and not awake:
        sleeping_cond = Condition("Sleeping", True, "AllReplicasSleeping", f"{sleeping} replicas asleep")
    elif sleeping:
        sleeping_cond = Condition(
            "Sleeping", False, "SomeReplicasSleeping", f"{sleeping} asleep, {awake} awake"
        )
    else:
        sleeping_cond = Condition("Sleeping", False, "Awake", f"{awake} replicas awake")

    if degraded.status:
        phase = "Degraded"
    elif deployment is None:
        phase = "Pending"
    elif progressing.status:
        phase = "Progressing"
    elif sleeping_cond.status:
        phase = "Sleeping"
    elif desired_replicas == 0:
        phase = "ScaledToZero"
    else:
        phase = "Ready"

    conditions = merge_conditions(
        previous_conditions,
        [ready_cond, progressing, degraded, sleeping_cond],
        generation=generation,
        now=now,
    )
    return {
        "observedGeneration": generation,
        "phase": phase,
        "servedName": served_name,
        "selector": selector,
        "replicas": replicas,
        "readyReplicas": ready,
        "awakeReplicas": awake,
        "sleepingReplicas": sleeping,
        "conditions": conditions,
    }


def failed_status(
    *,
    generation: int,
    reason: str,
    message: str,
    previous_conditions: Sequence[dict[str, Any]],
    now: datetime,
) -> dict[str, Any]:
    """Status of a model the operator refuses to reconcile (invalid spec)."""
    conditions = merge_conditions(
        previous_conditions,
        [
            Condition("Ready", False, reason, message),
            Condition("Progressing", False, reason, message),
            Condition("Degraded", True, reason, message),
        ],
        generation=generation,
        now=now,
    )
    return {"observedGeneration": generation, "phase": "Failed", "conditions": conditions}


def merge_conditions(
    previous: Sequence[dict[str, Any]], current: Sequence[Condition], *, generation: int, now: datetime
) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous}
    out: list[dict[str, Any]] = []
    for cond in current:
        status = "True" if cond.status else "False"
        old = before.get(cond.type, {})
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        out.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since or rfc3339(now),
                "observedGeneration": generation,
            }
        )
    return out


def newly_true(
    previous: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]], type_: str
) -> dict | None:
    """The ``type_`` condition if it just turned True or changed reason while True (worth an Event)."""
    old = next((c for c in previous if c.get("type") == type_), {})
    new = next((c for c in current if c.get("type") == type_), {})
    if new.get("status") == "True" and (
        old.get("status") != "True" or old.get("reason") != new.get("reason")
    ):
        return new
    return None


def status_changed(previous: dict[str, Any] | None, status: dict[str, Any]) -> bool:
    """Whether writing ``status`` would change any of its fields (a refresh that observed nothing new is
    not written, so it does not wake every watcher of the object)."""
    previous = previous or {}
    return any(previous.get(k) != v for k, v in status.items())


def replicas_to_sleep(
    *,
    idle_seconds: int,
    last_activity: float | None,
    active_since: float,
    now: float,
    heartbeats: Sequence[Heartbeat],
) -> list[Heartbeat]:
    """The awake, idle replicas idle-sleep should put to sleep now (empty when the model is not idle).

    ``last_activity`` is the model's last request (Redis); a model never used counts from
    ``active_since`` (when the operator started watching it). A replica still running or queueing
    requests is never put to sleep, whatever the timestamps say."""
    if idle_seconds <= 0:
        return []
    last = max(last_activity or 0.0, active_since)
    if now - last < idle_seconds:
        return []
    return [hb for hb in heartbeats if hb.state == "awake" and hb.running == 0 and hb.waiting == 0]


def asked_replicas(model: ModelSpec, status: dict[str, Any] | None) -> int:
    """The replicas the model's Deployment should have: ``spec.replicas`` for a fixed-size model; for an
    autoscaled one the autoscaler's last decision (``status.autoscaling.desiredReplicas``), kept inside
    [minReplicas, maxReplicas]; minReplicas before the first decision."""
    policy = model.autoscaling
    if policy is None:
        return model.replicas
    decided = ((status or {}).get("autoscaling") or {}).get("desiredReplicas")
    if not isinstance(decided, int):
        return policy.min_replicas
    return min(policy.max_replicas, max(policy.min_replicas, decided))


def cold_starting(status: dict[str, Any] | None) -> bool:
    """A cold start is under way: the autoscaler asked for a first replica and none has been ready since."""
    cold = ((status or {}).get("autoscaling") or {}).get("lastColdStart") or {}
    return bool(cold.get("startedAt")) and not cold.get("readyAt")
