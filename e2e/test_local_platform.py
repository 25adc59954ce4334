"""The platform end to end on one machine (issue 7): `kubectl` against the Kubernetes emulator, the real
operator, real engine processes run by the pod runner, a real Redis, and the real gateway in front.

Scenario: apply the example Tenant and the local InferenceModel -> Ready -> a chat completion (official
``openai`` client) at the replica's base URL from its Redis heartbeat, and through the gateway with the
tenant's key, traced from the client through the gateway into the engine -> ``kubectl scale`` to 2 -> two
live replicas; requests sharing a long prefix stick to one replica, unrelated ones spread over both -> sleep
the model through the gateway's admin API, a request wakes it -> SIGKILL one engine -> the pod restarts
(restartCount 1) and the model goes Degraded, then Ready again, and the gateway serves again -> ``kubectl
delete`` -> no engine process, the gateway answers 404 and no Redis key of the model is left -> delete the
tenant -> only what a running gateway keeps remains in Redis, and nothing but expiring rate-limit windows
once it stops.

Polls use generous timeouts: the engines load the model on a shared 2-core machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvfleet_common import redis_keys
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.hashing import hash_blocks
from kvfleet_common.schemas import Heartbeat
from kvfleet_devkit.kube_emulator import eventually
from kvfleet_devkit.local_platform import EXAMPLES, TENANT_KEY, LocalPlatform
from kvfleet_devkit.processes import group_members
from tests.server.test_tracing import OTLPReceiver

openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]

MODEL = "demo-tiny"  # examples/local-tiny.yaml
TENANT = "team-a"  # examples/tenant.yaml
NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{MODEL}"
STARTUP_S = 300  # an engine boot (torch import, model load) on a loaded machine, with margin
# ~500 tokens (~31 KV blocks of 16): far above what ties in the router's expected-time-to-first-token.
SYSTEM = (
    "You are the assistant of the kvfleet local platform: answer briefly and precisely, never invent "
    "facts, prefer short sentences and plain words, and say so when you do not know. "
) * 10


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def platform(tmp_path_factory, receiver) -> Iterator[LocalPlatform]:
    p = LocalPlatform(tmp_path_factory.mktemp("platform"), with_gateway=True, otlp_endpoint=receiver.url)
    p.start()
    try:
        p.build_demo_model()
        yield p
    finally:
        p.stop()


def condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def engine_pods(platform: LocalPlatform) -> list[dict]:
    assert platform.kube is not None
    return [p for p in platform.kube.list(PODS) if p["metadata"]["labels"].get("kvfleet.io/model") == MODEL]


def awake(store: FleetStore) -> list[Heartbeat]:
    return [hb for hb in store.live_replicas(MODEL) if hb.state == "awake"]


def pid_of(pod: dict) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("local://"))


def wait_ready(platform: LocalPlatform, replicas: int) -> dict:
    return eventually(
        lambda: (
            (s := platform.model_status(MODEL)).get("phase") == "Ready"
            and s.get("readyReplicas") == replicas
            and s
        ),
        timeout=STARTUP_S,
        interval=0.2,
    )


def chat(base_url: str) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello from the local platform"}], max_tokens=8
    )
    assert resp.model == MODEL and resp.usage is not None and resp.usage.completion_tokens > 0
    assert resp.choices[0].finish_reason in ("length", "stop")
    return resp.choices[0].message.content or ""


# ---- through the gateway ------------------------------------------------------------------------------


class Gateway:
    """The official SDK against the gateway with the example tenant's key; counts the requests it served
    (the tenant's usage in Redis must say the same)."""

    def __init__(self, platform: LocalPlatform) -> None:
        assert platform.gateway_url is not None
        self.url = platform.gateway_url
        self.admin_token = platform.admin_token
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=TENANT_KEY, max_retries=0, timeout=180)
        # With the admin token the gateway answers with its routing decision (x-kvfleet-route).
        self.debug = {"x-kvfleet-debug": self.admin_token}
        self.served = 0

    def chat(self, messages: list[dict], headers: dict[str, str] | None = None, max_tokens: int = 8):
        """A chat completion; (the parsed response, the response headers)."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, extra_headers={**self.debug, **(headers or {})}
        )
        resp = raw.parse()
        assert resp.model == MODEL and resp.usage is not None and resp.usage.completion_tokens > 0
        assert resp.choices[0].message.content
        self.served += 1
        return resp, raw.headers

    def complete(self, prompt: str):
        raw = self.client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_headers=self.debug
        )
        assert raw.parse().usage.completion_tokens == 1
        self.served += 1
        return raw.headers

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=180, **kw)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the gateway's /metrics (0 when absent)."""
        want = {f'{k}="{v}"' for k, v in labels.items()}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{") and want <= set(
                line[line.index("{") + 1 : line.index("}")].split(",")
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def system_prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def route(headers) -> dict:
    return json.loads(headers["x-kvfleet-route"])


def cached_blocks_in_redis(store: FleetStore, hb: Heartbeat, messages: list[dict]) -> bool:
    """Whether ``hb``'s KV blocks of this chat prompt (tenant-salted, as the gateway hashes them) are in
    Redis: the engine publishes them asynchronously, and the router can only stick once they are."""
    ids = httpx.post(f"{hb.base_url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    tenant = store.tenant_for_key_hash(hashlib.sha256(TENANT_KEY.encode()).hexdigest())
    assert tenant is not None
    hashes = hash_blocks(ids, hb.block_size, tenant.cache_salt)
    assert len(hashes) > 8  # "a long prefix": many blocks
    return store.prefix_match(MODEL, hashes, [hb.replica_id])[hb.replica_id] == len(hashes)


def assert_traced_through(receiver: OTLPReceiver, trace_id: str, client_span_id: str) -> None:
    """The client's trace continues in the gateway's routing span, and every engine span of the request
    descends from that span (through the FastAPI server spans, where there are some)."""

    def spans() -> dict:
        mine = {s.span_id.hex(): (svc, s) for svc, s in list(receiver.spans) if s.trace_id.hex() == trace_id}
        services = {(svc, s.name) for svc, s in mine.values()}
        return (
            ("kvfleet-gateway", "kvfleet.gateway.route") in services
            and ("kvfleet-engine", "engine chat") in services
            and mine
        )

    mine = eventually(spans, timeout=60, interval=0.2)

    def ancestry(span) -> list[str]:
        chain, parent = [], span.parent_span_id.hex()
        while parent in mine:
            chain.append(parent)
            parent = mine[parent][1].parent_span_id.hex()
        return [*chain, parent]  # the last one is outside what was exported: the client's span

    [route_span] = [s for svc, s in mine.values() if s.name == "kvfleet.gateway.route"]
    assert ancestry(route_span)[-1] == client_span_id
    engine = [s for svc, s in mine.values() if svc == "kvfleet-engine"]
    assert engine and all(route_span.span_id.hex() in ancestry(s) for s in engine), [s.name for s in engine]
    attrs = {a.key: a.value.string_value for a in route_span.attributes}
    assert attrs["kvfleet.tenant"] == TENANT and attrs["gen_ai.request.model"] == MODEL


def model_keys(store: FleetStore, pod_names: set[str]) -> list[str]:
    """Every Redis key that belongs to the model or to one of its replicas."""
    keys = [k.decode() for k in store.client.scan_iter("kvf:*")]
    return [
        k
        for k in keys
        if f":model:{MODEL}:" in k or any(f":{name}#" in k or k.endswith(f":{name}") for name in pod_names)
    ]


def redis_keys_besides_windows(store: FleetStore) -> list[str]:
    """Every kvf:* key except the tenant's rate-limit windows, which must expire on their own (TTL <= 120 s:
    a deleted tenant's last minute may still be counted, never forever)."""
    keys = sorted(k.decode() for k in store.client.scan_iter("kvf:*"))
    windows = [k for k in keys if k.startswith(f"kvf:ratelimit:{TENANT}:")]
    for k in windows:
        assert 0 < store.client.ttl(k) <= redis_keys.RATELIMIT_TTL_S, k
    return [k for k in keys if k not in windows]


def test_model_lifecycle_on_the_local_platform(platform: LocalPlatform, store: FleetStore, receiver):
    kube, runner = platform.kube, platform.runner
    assert kube is not None and runner is not None
    gateway = Gateway(platform)
    gateway_id = httpx.get(f"{gateway.url}/health", timeout=30).json()["gateway_id"]
    # 1. kubectl apply the tenant and the model from examples/.
    platform.kubectl(
        "apply",
        "--validate=false",
        "-f",
        str(EXAMPLES / "tenant.yaml"),
        "-f",
        str(EXAMPLES / "local-tiny.yaml"),
    )
    key_hash = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    tenant = eventually(lambda: store.tenant_for_key_hash(key_hash), timeout=60)
    assert tenant.name == TENANT

    # 2. The operator renders the Deployment, the pod runner starts the engine, the status becomes Ready.
    status = wait_ready(platform, 1)
    assert condition(status, "Ready")["status"] == "True" and status["servedName"] == MODEL
    assert platform.kubectl("get", "im", MODEL, "-o", "jsonpath={.status.phase}") == "Ready"
    (pod,) = engine_pods(platform)
    assert pod["status"]["containerStatuses"][0]["ready"] is True

    # 3. The replica announced itself in Redis; it answers a chat completion at that URL.
    (hb,) = eventually(lambda: awake(store), timeout=60)
    assert hb.name == pod["metadata"]["name"]  # KVFLEET_REPLICA_NAME from the downward API
    (local,) = runner.pods(deployment=MODEL)
    assert hb.base_url == f"http://127.0.0.1:{local.named_ports['http']}"  # KVFLEET_BASE_URL, rewritten
    assert chat(hb.base_url)
    assert store.get_model_policy(MODEL) is not None

    # 3b. The same through the gateway with the tenant's key, once its fleet snapshot has the model; the
    # client's trace continues through the gateway's routing span into the engine.
    eventually(lambda: MODEL in [m.id for m in gateway.client.models.list().data], timeout=60, interval=0.2)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    _, headers = gateway.chat(
        [{"role": "user", "content": "Hello through the gateway"}],
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
    )
    assert headers["x-kvfleet-replica"] == hb.replica_id
    assert_traced_through(receiver, trace_id, client_span)

    # 4. kubectl scale -> two engine processes, two live replicas in Redis.
    assert "scaled" in platform.kubectl("scale", f"im/{MODEL}", "--replicas=2")
    wait_ready(platform, 2)
    replicas = eventually(lambda: len(r := awake(store)) == 2 and r, timeout=60)
    pods = engine_pods(platform)
    assert {r.name for r in replicas} == {p["metadata"]["name"] for p in pods}
    assert len({r.base_url for r in replicas}) == 2
    for r in replicas:
        assert chat(r.base_url)
    ids = {r.replica_id for r in replicas}
    by_id = {r.replica_id: r for r in replicas}

    # 4b. Through the gateway: requests sharing a long system prompt stick to the replica that caches it
    # (predicted and actual cached tokens > 0) ...
    eventually(
        lambda: {c["replica"] for c in route(gateway.complete("zulu " * 4))["candidates"]} == ids,
        timeout=30,
        interval=0.2,
    )  # the gateway's snapshot has both replicas
    first = system_prompt("Which replica answers this?")
    _, headers = gateway.chat(first)
    sticky = headers["x-kvfleet-replica"]
    assert sticky in ids
    eventually(lambda: cached_blocks_in_redis(store, by_id[sticky], first), timeout=60, interval=0.2)
    for question in ("What is a KV block?", "Why route by prefix?", "Who wins a tie?"):
        resp, headers = gateway.chat(system_prompt(question))
        decision = route(headers)
        assert headers["x-kvfleet-replica"] == sticky, decision
        assert (
            decision["candidates"][0]["replica"] == sticky and decision["candidates"][0]["matched_tokens"] > 0
        )
        assert resp.usage.prompt_tokens_details.cached_tokens > 0
    # ... while short prompts with nothing in common spread over both replicas.
    spread = [
        gateway.complete(f"{word} " * 12)
        for word in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
    ]
    assert {h["x-kvfleet-replica"] for h in spread} == ids, [h["x-kvfleet-route"] for h in spread]

    # 4c. Sleep the model through the admin API: both replicas report sleeping in Redis; a request through
    # the gateway wakes them (wake-on-request) and succeeds.
    r = gateway.admin("POST", f"/admin/models/{MODEL}/sleep", params={"level": 1})
    assert r.status_code == 200 and set(r.json()["replicas"]) == ids, r.text
    eventually(
        lambda: (
            {hb.replica_id: hb.state for hb in store.live_replicas(MODEL)}
            == dict.fromkeys(ids, "sleeping")
        ),
        timeout=60,
        interval=0.2,
    )
    eventually(
        lambda: gateway.metric("kvfleet_gateway_replicas", model=MODEL, state="sleeping") == 2,
        timeout=30,
        interval=0.2,
    )  # the gateway's snapshot says so too (else it would send the request to a sleeping engine)
    woke_before = gateway.metric("kvfleet_gateway_wakes_total", model=MODEL, outcome="woke")
    _, headers = gateway.chat([{"role": "user", "content": "Wake up, please"}])
    assert headers["x-kvfleet-replica"] in ids
    assert gateway.metric("kvfleet_gateway_wakes_total", model=MODEL, outcome="woke") == woke_before + 1
    eventually(lambda: {hb.replica_id for hb in awake(store)} == ids, timeout=60, interval=0.2)

    # 5. SIGKILL one engine: the pod restarts it, the model is Degraded meanwhile, then Ready again.
    victim = pods[0]
    victim_pid = pid_of(victim)
    os.kill(victim_pid, signal.SIGKILL)
    phases: list[str] = []

    def recovered() -> bool:
        s = platform.model_status(MODEL)
        if not phases or phases[-1] != s.get("phase"):
            phases.append(s.get("phase", ""))
        assert "Degraded" in phases and s.get("phase") == "Ready" and s.get("readyReplicas") == 2, phases
        return True

    eventually(recovered, timeout=STARTUP_S, interval=0.1)
    assert phases.index("Degraded") < len(phases) - 1, phases
    warnings = eventually(lambda: [e for e in kube.events_for(MODEL) if e["type"] == "Warning"])
    assert any(victim["metadata"]["name"] in e["message"] for e in warnings), warnings
    (again,) = [p for p in engine_pods(platform) if p["metadata"]["name"] == victim["metadata"]["name"]]
    cs = again["status"]["containerStatuses"][0]
    assert cs["restartCount"] == 1 and cs["ready"] is True
    assert cs["lastState"]["terminated"]["exitCode"] == 137
    assert pid_of(again) != victim_pid and group_members(victim_pid) == []
    replicas = eventually(lambda: len(r := awake(store)) == 2 and r, timeout=60)
    restarted = next(r for r in replicas if r.name == victim["metadata"]["name"])
    assert chat(restarted.base_url)
    # The gateway serves again (a stale entry of the killed replica is retried on the other one).
    for _ in range(2):
        _, headers = gateway.chat([{"role": "user", "content": "Still there after the crash?"}])
        assert headers["x-kvfleet-replica"] in {r.replica_id for r in replicas}

    # 6. kubectl delete waits for the finalizer: the pods stop, then the operator purges the model from
    # Redis (purging earlier would let a stopping engine re-register and re-publish its tokenizer).
    pod_names = {p["metadata"]["name"] for p in engine_pods(platform)}
    groups = runner.process_groups()
    platform.kubectl("delete", "--timeout=180s", "-f", str(EXAMPLES / "local-tiny.yaml"))
    assert kube.get(DEPLOYMENT) is None and engine_pods(platform) == []
    assert runner.pods(deployment=MODEL) == []
    assert model_keys(store, pod_names) == []
    assert store.live_replicas(MODEL) == [] and MODEL not in store.list_models()
    assert store.get_model_policy(MODEL) is None
    eventually(lambda: all(group_members(g) == [] for g in groups), timeout=60)

    # The gateway forgets the model at its next fleet snapshot refresh (~0.5 s): 404, OpenAI-shaped.
    def not_found():
        try:
            gateway.chat([{"role": "user", "content": "anyone?"}])
        except openai.NotFoundError as e:
            return e
        except openai.APIStatusError as e:  # 503 while its snapshot still lists the model without replicas
            assert e.status_code == 503, e
        raise AssertionError("the deleted model still answered")

    assert eventually(not_found, timeout=30, interval=0.2).body["code"] == "model_not_found"
    assert "demo-tiny" not in [m.id for m in gateway.client.models.list().data]
    # What the gateway metered for the tenant: one usage record per request it served.
    usage = eventually(
        lambda: (u := store.tenant_usage([TENANT])[TENANT])["total"]["requests"] == gateway.served and u,
        timeout=30,
    )
    assert usage["models"][MODEL]["requests"] == gateway.served and usage["total"]["cached_tokens"] > 0
    tenant_keys = [
        "kvf:apikey:" + key_hash,
        f"kvf:tenant:{TENANT}",
        f"kvf:tenant:{TENANT}:keys",
        "kvf:tenants",
        f"kvf:usage:{TENANT}",
    ]
    # kvf:gateway:<id>:load is absent: nothing is in flight (the gateway deletes it rather than write zeros).
    assert redis_keys_besides_windows(store) == sorted([*tenant_keys, "kvf:gateways"])

    # The tenant goes too (its usage with it); a running gateway still announces itself in kvf:gateways.
    platform.kubectl("delete", "--timeout=60s", "-f", str(EXAMPLES / "tenant.yaml"))
    assert store.tenant_for_key_hash(key_hash) is None
    assert redis_keys_besides_windows(store) == ["kvf:gateways"]
    assert store.client.zrange("kvf:gateways", 0, -1) == [gateway_id.encode()]
    # A stopped gateway removes itself: nothing of the scenario is left but expiring rate-limit windows.
    platform.stop_gateway()
    assert redis_keys_besides_windows(store) == []


def test_stopping_the_platform_leaves_no_process(tmp_path: Path):
    """Stopping the platform while an engine runs: no process survives, the logs stay in the given dir."""
    with LocalPlatform(tmp_path / "p", operator_idle_check_s=1.0, with_gateway=True) as p:
        p.build_demo_model()
        p.kubectl("apply", "--validate=false", "-f", str(EXAMPLES / "local-tiny.yaml"))
        runner = p.runner
        assert runner is not None
        eventually(lambda: any(pod.pid for pod in runner.pods(deployment=MODEL)), timeout=120)
        groups = runner.process_groups()
        operator, gateway = p.operator, p.gateway
        assert (
            groups and all(group_members(g) for g in groups) and operator is not None and gateway is not None
        )
    # stop() SIGTERMed the engine mid-start (it raises if anything is left); check independently too.
    assert all(group_members(g) == [] for g in groups)
    assert operator.poll() is not None and gateway.poll() is not None
    assert group_members(gateway.pid) == []
    assert (tmp_path / "p" / "operator.log").exists() and (tmp_path / "p" / "gateway.log").exists()
