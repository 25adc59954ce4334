"""Unit tests of the pure status and idle-sleep policy (no servers)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvfleet_common.schemas import Heartbeat
from kvfleet_operator.status import (
    merge_conditions,
    model_status,
    newly_true,
    pod_problems,
    replicas_to_sleep,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def hb(name: str, state: str, running: int = 0, waiting: int = 0) -> Heartbeat:
    return Heartbeat(
        replica_id=f"{name}#1",
        name=name,
        model="m",
        base_url=f"http://{name}:8000",
        state=state,
        running=running,
        waiting=waiting,
        block_size=16,
        max_model_len=1024,
        started_at=0.0,
        updated_at=0.0,
    )


def deployment(
    *, want: int, ready: int, updated: int | None = None, replicas: int | None = None, conditions=()
):
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": want},
        "status": {
            "observedGeneration": 2,
            "replicas": want if replicas is None else replicas,
            "updatedReplicas": want if updated is None else updated,
            "readyReplicas": ready,
            "conditions": list(conditions),
        },
    }


def status(**kw):
    base = dict(desired_replicas=2, generation=5, served_name="m", selector="s", heartbeats=(), now=NOW)
    base.update(kw)
    return model_status(**base)


def cond(st: dict, type_: str) -> dict:
    return next(c for c in st["conditions"] if c["type"] == type_)


def test_no_deployment_yet_is_pending():
    st = status(deployment=None)
    assert st["phase"] == "Pending"
    assert cond(st, "Progressing")["status"] == "True" and cond(st, "Ready")["status"] == "False"
    assert st["observedGeneration"] == 5


def test_all_ready_is_ready_and_rollout_is_progressing():
    st = status(deployment=deployment(want=2, ready=2))
    assert st["phase"] == "Ready" and cond(st, "Ready")["reason"] == "AllReplicasReady"
    assert cond(st, "Progressing")["status"] == "False"
    rolling = status(deployment=deployment(want=2, ready=2, updated=1))
    assert rolling["phase"] == "Progressing" and cond(rolling, "Progressing")["reason"] == "RollingOut"
    shrinking = status(desired_replicas=1, deployment=deployment(want=1, ready=1, replicas=2))
    assert cond(shrinking, "Progressing")["reason"] == "ScalingDown"


def test_deadline_exceeded_and_replica_failure_degrade():
    stuck = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": "timed out",
    }
    st = status(deployment=deployment(want=2, ready=0, conditions=[stuck]))
    assert st["phase"] == "Degraded" and cond(st, "Degraded")["reason"] == "ProgressDeadlineExceeded"
    quota = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": "exceeded quota",
    }
    st = status(deployment=deployment(want=2, ready=1, conditions=[quota]))
    assert cond(st, "Degraded")["reason"] == "FailedCreate" and "quota" in cond(st, "Degraded")["message"]


def test_broken_pods_are_named():
    pods = [
        {
            "metadata": {"name": "p1"},
            "status": {
                "initContainerStatuses": [
                    {
                        "name": "fetch-model",
                        "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}},
                    }
                ],
                "containerStatuses": [
                    {"name": "engine", "state": {"waiting": {"reason": "PodInitializing"}}}
                ],
            },
        },
        {
            "metadata": {"name": "p2"},
            "status": {"containerStatuses": [{"name": "engine", "state": {"running": {}}}]},
        },
    ]
    (problem,) = pod_problems(pods)
    assert (problem.pod, problem.container, problem.reason) == ("p1", "fetch-model", "ErrImagePull")
    st = status(deployment=deployment(want=2, ready=1), pods=pods)
    assert st["phase"] == "Degraded" and "p1" in cond(st, "Degraded")["message"]


def test_a_crashed_container_degrades_until_it_is_ready_again():
    # The kubelet restarts a first crash at once: running again, not ready, the crash in lastState.
    crashed = {
        "name": "engine",
        "ready": False,
        "restartCount": 1,
        "state": {"running": {"startedAt": "2026-01-01T12:00:00Z"}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}},
    }
    pods = [{"metadata": {"name": "p1"}, "status": {"containerStatuses": [crashed]}}]
    (problem,) = pod_problems(pods)
    assert (problem.pod, problem.reason) == ("p1", "ContainerRestarted") and "code 137" in problem.message
    st = status(deployment=deployment(want=2, ready=1), pods=pods)
    assert st["phase"] == "Degraded" and "p1" in cond(st, "Degraded")["message"]
    oom = {**crashed, "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    assert pod_problems([{"metadata": {"name": "p1"}, "status": {"containerStatuses": [oom]}}])[0].reason == (
        "OOMKilled"
    )
    # Ready again: the old crash stays in lastState but is no longer a problem.
    recovered = [{"metadata": {"name": "p1"}, "status": {"containerStatuses": [{**crashed, "ready": True}]}}]
    assert pod_problems(recovered) == []
    assert status(deployment=deployment(want=2, ready=2), pods=recovered)["phase"] == "Ready"


def test_sleeping_counts_come_from_heartbeats():
    st = status(deployment=deployment(want=2, ready=2), heartbeats=[hb("a", "sleeping"), hb("b", "sleeping")])
    assert st["phase"] == "Sleeping" and st["sleepingReplicas"] == 2 and st["awakeReplicas"] == 0
    mixed = status(deployment=deployment(want=2, ready=2), heartbeats=[hb("a", "sleeping"), hb("b", "awake")])
    assert mixed["phase"] == "Ready" and cond(mixed, "Sleeping")["reason"] == "SomeReplicasSleeping"


def test_scaled_to_zero():
    st = status(desired_replicas=0, deployment=deployment(want=0, ready=0))
    assert st["phase"] == "ScaledToZero" and cond(st, "Ready")["reason"] == "ScaledToZero"


def test_transition_time_moves_only_when_status_flips():
    first = status(deployment=deployment(want=2, ready=1))
    later = NOW + timedelta(minutes=5)
    same = status(deployment=deployment(want=2, ready=1), previous_conditions=first["conditions"], now=later)
    assert cond(same, "Ready")["lastTransitionTime"] == cond(first, "Ready")["lastTransitionTime"]
    flipped = status(
        deployment=deployment(want=2, ready=2), previous_conditions=first["conditions"], now=later
    )
    assert cond(flipped, "Ready")["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    assert newly_true(first["conditions"], flipped["conditions"], "Ready")["reason"] == "AllReplicasReady"
    assert newly_true(flipped["conditions"], flipped["conditions"], "Ready") is None
    assert merge_conditions([], [], generation=1, now=NOW) == []


def test_idle_sleep_policy():
    replicas = [
        hb("a", "awake"),
        hb("b", "awake", running=1),
        hb("c", "sleeping"),
        hb("d", "awake", waiting=2),
    ]
    kw = dict(idle_seconds=60, active_since=1000.0, heartbeats=replicas)
    # Idle long enough: only awake replicas with nothing running or queued.
    assert [r.name for r in replicas_to_sleep(last_activity=1000.0, now=1061.0, **kw)] == ["a"]
    # A recent request keeps the model awake.
    assert replicas_to_sleep(last_activity=1050.0, now=1061.0, **kw) == []
    # Never used: counted from when the operator started watching it.
    assert replicas_to_sleep(last_activity=None, now=1030.0, **kw) == []
    assert [r.name for r in replicas_to_sleep(last_activity=None, now=1100.0, **kw)] == ["a"]
    # 0 disables idle sleep.
    assert replicas_to_sleep(last_activity=0.0, now=1e9, **{**kw, "idle_seconds": 0}) == []
