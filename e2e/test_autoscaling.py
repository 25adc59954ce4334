"""Autoscaling and scale to zero end to end (issue 26): `kubectl` against the Kubernetes emulator, the real
operator (its autoscaler ticking every 0.5 s), real engine processes run by the pod runner, a real Redis and
the real gateway.

Scenario, on ``examples/autoscaled-tiny.yaml`` (minReplicas 0, maxReplicas 3, 2 requests in flight per
replica; windows shortened for the test):

1. applied, the model has no replica (ScaledToZero);
2. the first request is held at the gateway (the hold shows in Redis), the autoscaler cold-starts one replica,
   and the request is answered: no 5xx;
3. a bounded load generator (8 concurrent streams) keeps ~8 requests in flight: the model grows to 3 replicas;
4. the load falls to 2 long streams: after the delay the model shrinks to 1. The replicas removed were
   serving some of those streams: each stream still ends complete (the replica drains before it goes);
5. no load: after scaleToZeroAfterSeconds the last replica goes, and no engine process is left.

Every response of every phase is checked: no 5xx, every stream complete. Timeouts are generous (engines
boot on a shared 2-core machine); the scale decisions themselves are read from the operator's status and
Events, not timed.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_devkit.kube_emulator import eventually
from kvfleet_devkit.local_platform import EXAMPLES, LocalPlatform

pytestmark = [
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]

MODEL = "demo-tiny-auto"  # examples/autoscaled-tiny.yaml
NS = "default"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{MODEL}"
PODS = f"/api/v1/namespaces/{NS}/pods"
STARTUP_S = 300  # engine boots on a loaded 2-core machine, with margin
LOAD_KEY = "sk-autoscale-load"
# A tenant of its own: the load generator must meet the autoscaler, not the example tenant's rate limits.
LOAD_TENANT = f"""
apiVersion: v1
kind: Secret
metadata: {{name: autoscale-load-key, namespace: kvfleet-system}}
type: Opaque
stringData: {{apiKey: {LOAD_KEY}}}
---
apiVersion: kvfleet.io/v1alpha1
kind: Tenant
metadata: {{name: autoscale-load}}
spec:
  apiKeySecretRef: {{name: autoscale-load-key, namespace: kvfleet-system, key: apiKey}}
  models: ["demo-*"]
  limits: {{requestsPerMinute: 100000, tokensPerMinute: 100000000, maxConcurrent: 64}}
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> Iterator[LocalPlatform]:
    p = LocalPlatform(
        tmp_path_factory.mktemp("autoscale"),
        with_gateway=True,
        operator_autoscale_s=0.5,
        gateway_args=("--wake-timeout", str(STARTUP_S)),
    )
    p.start()
    try:
        p.build_demo_model()
        yield p
    finally:
        p.stop()


@dataclass
class Outcomes:
    """Every response of a phase: status codes, and for 200s whether the stream ended complete."""

    statuses: list[int] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: int, problem: str | None = None) -> None:
        with self.lock:
            self.statuses.append(status)
            if problem:
                self.incomplete.append(problem)

    def check(self) -> None:
        assert self.statuses, "no request was made"
        assert all(s == 200 for s in self.statuses), sorted(set(self.statuses))
        assert not self.incomplete, self.incomplete[:3]


def stream_chat(client: httpx.Client, gateway: str, max_tokens: int, out: Outcomes) -> None:
    """One streamed chat completion through the gateway; complete = a finish_reason, [DONE], and usage
    saying every token the stream carried was generated (min_tokens keeps it from stopping early)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about autoscaling."}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {LOAD_KEY}"}
    try:
        with client.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                resp.read()
                out.add(resp.status_code, f"{resp.status_code}: {resp.text[:200]}")
                return
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:  # a cut stream: the failure this test exists to catch
        out.add(599, f"transport: {e!r}")
        return
    finished = any('"finish_reason":"length"' in x.replace(" ", "") for x in lines)
    usage_ok = any(f'"completion_tokens":{max_tokens}' in x.replace(" ", "") for x in lines)
    done = bool(lines) and lines[-1] == "data: [DONE]"
    out.add(200, None if (finished and usage_ok and done) else f"incomplete stream: {lines[-3:]}")


class LoadGenerator:
    """``workers`` threads, each sending streamed chats back to back until stopped (bounded load)."""

    def __init__(self, gateway: str, workers: int, max_tokens: int) -> None:
        self.outcomes = Outcomes()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(gateway, max_tokens), daemon=True)
            for _ in range(workers)
        ]

    def _work(self, gateway: str, max_tokens: int) -> None:
        with httpx.Client(timeout=STARTUP_S) as client:
            while not self._stop.is_set():
                stream_chat(client, gateway, max_tokens, self.outcomes)

    def __enter__(self) -> LoadGenerator:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(STARTUP_S)
        assert not any(t.is_alive() for t in self._threads), "a request never ended"


def deployment_replicas(platform: LocalPlatform) -> int:
    assert platform.kube is not None
    return int(platform.kube.get(DEPLOYMENT)["spec"].get("replicas", 0))


def autoscaling(platform: LocalPlatform) -> dict:
    return platform.model_status(MODEL).get("autoscaling") or {}


def engine_pods(platform: LocalPlatform) -> list[dict]:
    assert platform.kube is not None
    return [p for p in platform.kube.list(PODS) if p["metadata"]["labels"].get("kvfleet.io/model") == MODEL]


def event_reasons(platform: LocalPlatform) -> list[str]:
    assert platform.kube is not None
    events = platform.kube.list(f"/api/v1/namespaces/{NS}/events")
    return [e.get("reason", "") for e in events if e.get("involvedObject", {}).get("name") == MODEL]


def test_from_zero_to_three_and_back_to_zero(platform: LocalPlatform, store: FleetStore) -> None:
    assert platform.gateway_url is not None and platform.runner is not None
    gateway = platform.gateway_url
    platform.kubectl("apply", "--validate=false", "-f", "-", input_text=LOAD_TENANT)
    platform.kubectl("apply", "--validate=false", "-f", str(EXAMPLES / "autoscaled-tiny.yaml"))

    # 1. applied: no replica, and the gateways know the model may be scaled from zero
    eventually(lambda: autoscaling(platform).get("reason") == "ScaledToZero", timeout=60, interval=0.2)
    assert deployment_replicas(platform) == 0 and not engine_pods(platform)
    policy = eventually(lambda: store.get_model_policy(MODEL), timeout=30)
    assert policy.scale_from_zero

    # 2. the first request is held (visible fleet-wide in Redis), a replica cold-starts, the request is served
    first = Outcomes()
    with httpx.Client(timeout=STARTUP_S) as client:
        held = threading.Thread(target=stream_chat, args=(client, gateway, 8, first))
        held.start()
        eventually(lambda: store.model_load(MODEL).held >= 1, timeout=60, interval=0.05)
        eventually(lambda: deployment_replicas(platform) == 1, timeout=60, interval=0.1)
        held.join(STARTUP_S)
    assert not held.is_alive()
    first.check()
    cold = eventually(lambda: autoscaling(platform).get("lastColdStart", {}).get("readyAt") and autoscaling(platform),
                      timeout=60, interval=0.2)  # fmt: skip
    assert cold["coldStarts"] == 1 and cold["lastColdStart"]["seconds"] > 0
    assert "ColdStart" in event_reasons(platform)
    assert store.model_load(MODEL).held == 0

    # 3. a sustained burst (~8 in flight for a target of 2 per replica) grows the model to its maximum
    with LoadGenerator(gateway, workers=8, max_tokens=48) as burst:
        eventually(lambda: deployment_replicas(platform) == 3, timeout=120, interval=0.2)
        eventually(
            lambda: platform.model_status(MODEL).get("readyReplicas") == 3, timeout=STARTUP_S, interval=0.5
        )
        # every replica takes part before the burst ends
        eventually(lambda: len([hb for hb in store.live_replicas(MODEL) if hb.state == "awake"]) == 3,
                   timeout=60, interval=0.2)  # fmt: skip
        served_before = len(burst.outcomes.statuses)
        eventually(lambda: len(burst.outcomes.statuses) >= served_before + 16, timeout=120, interval=0.2)
    burst.outcomes.check()
    assert "ScaleUp" in event_reasons(platform)

    # 4. the load falls to 2 long streams: 3 -> 1 after the delay; streams on the removed replicas still end
    with LoadGenerator(gateway, workers=2, max_tokens=160) as trickle:
        eventually(lambda: deployment_replicas(platform) == 1, timeout=120, interval=0.2)
        eventually(lambda: len(engine_pods(platform)) == 1, timeout=120, interval=0.2)
    trickle.outcomes.check()
    assert "ScaleDown" in event_reasons(platform)

    # 5. no load: the last replica goes after scaleToZeroAfterSeconds, and with it every engine process
    eventually(lambda: deployment_replicas(platform) == 0, timeout=120, interval=0.2)
    eventually(lambda: not engine_pods(platform), timeout=120, interval=0.2)
    eventually(lambda: not platform.runner.pods(NS, MODEL), timeout=120, interval=0.2)
    assert autoscaling(platform)["reason"] in ("ScaleToZero", "ScaledToZero")
    assert "ScaleToZero" in event_reasons(platform)
    assert not platform.runner.leftover_processes()
    # the operator's metric counted each kind of change
    operator_metrics = platform.operator_metrics()
    for reason in ("ColdStart", "ScaleUp", "ScaleDown", "ScaleToZero"):
        assert f'reason="{reason}"' in operator_metrics, reason
