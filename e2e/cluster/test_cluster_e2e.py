"""The platform end to end on a real Kubernetes cluster (kind or k3d): the Helm chart, the CPU engine image,
`kubectl` and the official ``openai`` client, through the gateway. Set-up, step by step: e2e/cluster/README.md.

Scenario: apply the example Tenant and InferenceModel -> Ready -> a chat completion through the gateway with
the tenant's key -> ``kubectl scale`` to 2 replicas -> requests sharing a prefix stick to one replica while
unrelated ones spread -> sleep the model through the gateway's admin API -> a request wakes it and succeeds ->
kill one engine process -> the model turns Degraded, then Ready again -> delete -> no pod and no Redis key of
the model left (and none of the tenant once it is deleted too).

Skipped unless a cluster is named: ``KVFLEET_E2E_KUBECONFIG=/path/to/kubeconfig``, or ``KUBECONFIG`` together
with ``KVFLEET_E2E_CLUSTER=1`` (so that a developer's everyday kubeconfig is never used by accident). It does
not install anything: the README's ``helm install`` comes first.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

KUBECONFIG = os.environ.get("KVFLEET_E2E_KUBECONFIG") or (
    os.environ.get("KUBECONFIG") if os.environ.get("KVFLEET_E2E_CLUSTER") == "1" else None
)
RELEASE_NS = os.environ.get("KVFLEET_E2E_NAMESPACE", "kvfleet-system")  # helm install -n
FULLNAME = os.environ.get("KVFLEET_E2E_RELEASE", "kvfleet")  # the release's object prefix (release "kvfleet")
MODEL_NS = os.environ.get("KVFLEET_E2E_MODEL_NAMESPACE", "default")
STARTUP_S = float(os.environ.get("KVFLEET_E2E_STARTUP_TIMEOUT", "600"))  # image pull + model load, per step

MODEL = "demo-llama"  # examples/demo-cpu.yaml
TENANT = "team-a"  # examples/tenant.yaml
TENANT_KEY = "sk-team-a-change-me"

pytestmark = [
    pytest.mark.skipif(
        not KUBECONFIG, reason="no cluster: set KVFLEET_E2E_KUBECONFIG (see e2e/cluster/README.md)"
    ),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
    pytest.mark.timeout(3600),
]

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float, interval: float = 1.0, what: str = "") -> T:
    """Call ``check`` until it returns something truthy without raising; re-raise its last error on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
            error: Exception = AssertionError(f"still false: {what or check}")
        except Exception as e:
            error = e
        if time.monotonic() > deadline:
            raise error
        time.sleep(interval)


# ---- kubectl ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Kubectl:
    kubeconfig: str

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 600) -> str:
        cmd = ["kubectl", f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    @contextmanager
    def port_forward(self, namespace: str, target: str, port: int) -> Iterator[int]:
        """``kubectl port-forward`` to ``target`` (e.g. ``svc/x``) on a free local port, for the block's life."""
        proc = subprocess.Popen(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", "-n", namespace, "port-forward",
             "--address=127.0.0.1", target, f":{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "Forwarding from 127.0.0.1:43121 -> 8080"
        m = re.search(r"127\.0\.0\.1:(\d+)", first)
        if m is None:
            proc.kill()
            raise AssertionError(f"kubectl port-forward {target}: {first}{proc.stdout.read()}")
        # Keep draining its output ("Handling connection for ...") so the pipe never fills up.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        try:
            yield int(m[1])
        finally:
            proc.terminate()
            proc.wait(timeout=10)


# ---- the platform as the test sees it -------------------------------------------------------------------


@dataclass(slots=True)
class Cluster:
    kubectl: Kubectl
    gateway_url: str
    admin_token: str
    phases: list[str] = field(default_factory=list)

    def model_status(self) -> dict:
        obj = self.kubectl.json("-n", MODEL_NS, "get", "inferencemodel", MODEL)
        return obj.get("status", {})

    def engine_pods(self) -> list[dict]:
        selector = f"kvfleet.io/model={MODEL}"
        return self.kubectl.json("-n", MODEL_NS, "get", "pods", "-l", selector)["items"]

    def wait_phase(self, phase: str, ready: int | None = None, timeout: float = STARTUP_S) -> dict:
        def check() -> dict | None:
            s = self.model_status()
            if not self.phases or self.phases[-1] != s.get("phase"):
                self.phases.append(s.get("phase", ""))
            ok = s.get("phase") == phase and (ready is None or s.get("readyReplicas") == ready)
            return s if ok else None

        return eventually(
            check, timeout, what=f"{MODEL} phase {phase} with {ready} ready (seen {self.phases})"
        )

    def admin(self, method: str, path: str, **kw) -> Any:
        import httpx

        headers = {"Authorization": f"Bearer {self.admin_token}"}
        r = httpx.request(method, f"{self.gateway_url}{path}", headers=headers, timeout=300, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def replica_states(self) -> list[str]:
        models = self.admin("GET", "/admin/models")["data"]
        return [r["state"] for m in models if m["name"] == MODEL for r in m["replicas"]]

    def redis_keys(self) -> list[str]:
        out = self.kubectl(
            "-n", RELEASE_NS, "exec", f"deploy/{FULLNAME}-redis", "--", "redis-cli", "--scan", "--pattern", "kvf:*"
        )  # fmt: skip
        return sorted(line for line in out.splitlines() if line)

    def redis(self, *command: str) -> str:
        return self.kubectl("-n", RELEASE_NS, "exec", f"deploy/{FULLNAME}-redis", "--", "redis-cli", *command)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    assert KUBECONFIG is not None
    kubectl = Kubectl(KUBECONFIG)
    # The release must be installed and serving (README: helm install ... --wait).
    kubectl("-n", RELEASE_NS, "rollout", "status", f"deploy/{FULLNAME}-gateway", "--timeout=300s")
    kubectl("-n", RELEASE_NS, "rollout", "status", f"deploy/{FULLNAME}-operator", "--timeout=300s")
    claim = kubectl("-n", MODEL_NS, "get", "pvc", "kvfleet-models", "--ignore-not-found", "-o", "name")
    assert claim.strip(), (
        "the model claim is missing: run the README's `kubectl apply -f e2e/cluster/demo-model.yaml`"
    )
    secret = kubectl.json("-n", RELEASE_NS, "get", "secret", f"{FULLNAME}-credentials")
    token = base64.b64decode(secret["data"]["admin-token"]).decode()
    with kubectl.port_forward(RELEASE_NS, f"svc/{FULLNAME}-gateway", 80) as port:
        c = Cluster(kubectl, f"http://127.0.0.1:{port}", token)
        try:
            yield c
        finally:  # leave the cluster as we found it, also when a step failed
            kubectl("-n", MODEL_NS, "delete", "inferencemodel", MODEL, "--ignore-not-found", "--timeout=300s",
                    check=False)  # fmt: skip
            kubectl(
                "delete",
                "-f",
                str(EXAMPLES / "tenant.yaml"),
                "--ignore-not-found",
                "--timeout=120s",
                check=False,
            )


def example_model(replicas: int) -> str:
    """examples/demo-cpu.yaml with ``replicas`` (the scenario starts at one and scales to two)."""
    doc = yaml.safe_load((EXAMPLES / "demo-cpu.yaml").read_text())
    assert doc["metadata"]["name"] == MODEL
    doc["spec"]["replicas"] = replicas
    return yaml.safe_dump(doc, sort_keys=False)


def openai_client(c: Cluster, key: str = TENANT_KEY):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{c.gateway_url}/v1", api_key=key, max_retries=0, timeout=300)


@dataclass(slots=True)
class Answer:
    replica: str
    text: str
    prompt_tokens: int
    cached_tokens: int


def chat(c: Cluster, messages: list[dict], max_tokens: int = 8) -> Answer:
    raw = openai_client(c).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    resp = raw.parse()
    assert resp.model == MODEL and resp.usage is not None and resp.usage.completion_tokens > 0
    assert resp.choices[0].finish_reason in ("length", "stop")
    details = resp.usage.prompt_tokens_details
    replica = raw.headers.get("x-kvfleet-replica")
    assert replica, "the gateway names the replica that served the request (x-kvfleet-replica)"
    return Answer(
        replica=replica,
        text=resp.choices[0].message.content or "",
        prompt_tokens=resp.usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
    )


def words(n: int, seed: str) -> str:
    """``n`` pseudo-random words: a prompt no other prompt of the run shares a prefix with."""
    rng = uuid.uuid5(uuid.NAMESPACE_OID, seed).int
    vocab = ["harbour", "lantern", "granite", "meadow", "copper", "violet", "thunder", "orchard", "pebble",
             "saffron", "glacier", "willow", "ember", "quartz", "canyon", "falcon"]  # fmt: skip
    out = []
    for _ in range(n):
        out.append(vocab[rng % len(vocab)])
        rng = (rng * 6364136223846793005 + 1442695040888963407) % (1 << 128)
    return " ".join(out)


KILL_ENGINE_CORE = """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        continue
    if ppid == 1:  # the API server (PID 1) spawned it: the engine core
        os.kill(int(pid), signal.SIGKILL)
        print(pid)
"""


def test_model_lifecycle_on_a_real_cluster(cluster: Cluster):
    c, kubectl = cluster, cluster.kubectl

    # 1. The example Tenant (its key Secret in the release namespace) and the example model, at one replica.
    kubectl("apply", "-f", str(EXAMPLES / "tenant.yaml"))
    kubectl("-n", MODEL_NS, "apply", "-f", "-", stdin=example_model(replicas=1))
    tenant = eventually(
        lambda: (t := kubectl.json("get", "tenant", TENANT)).get("status", {}).get("phase") == "Active" and t,
        timeout=120,
    )
    assert tenant["spec"]["apiKeySecretRef"]["name"] == "team-a-api-key"

    # 2. The operator renders the Deployment; the engine loads the model; the status turns Ready.
    status = c.wait_phase("Ready", ready=1)
    assert status["servedName"] == MODEL
    assert kubectl("-n", MODEL_NS, "get", "im", MODEL, "-o", "jsonpath={.status.phase}") == "Ready"

    # 3. A chat completion through the gateway with the tenant's key; a wrong key is refused.
    first = eventually(lambda: chat(c, [{"role": "user", "content": "Hello from the cluster"}]), timeout=120)
    assert first.prompt_tokens > 0
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError):
        openai_client(c, key="sk-not-a-tenant").models.list()

    # 4. Scale to two replicas: both become Ready and the gateway sees two awake replicas.
    assert "scaled" in kubectl("-n", MODEL_NS, "scale", f"im/{MODEL}", "--replicas=2")
    c.wait_phase("Ready", ready=2)
    eventually(lambda: c.replica_states().count("awake") == 2, timeout=120, what="two awake replicas")

    # 5. Requests sharing a long prefix stick to one replica, and hit its prefix cache; unrelated ones spread.
    system = {
        "role": "system",
        "content": "You are a terse assistant for the lighthouse. " + words(160, "shared"),
    }
    shared = [
        chat(c, [system, {"role": "user", "content": f"Question {i}: {words(6, f'q{i}')}"}]) for i in range(6)
    ]
    assert len({a.replica for a in shared}) == 1, [a.replica for a in shared]
    assert all(a.cached_tokens > 0 for a in shared[1:]), [a.cached_tokens for a in shared]
    unrelated = [chat(c, [{"role": "user", "content": words(120, f"unrelated-{i}")}]) for i in range(8)]
    assert len({a.replica for a in unrelated}) == 2, [a.replica for a in unrelated]

    # 6. Sleep the model through the admin API; every replica reports sleeping, then a request wakes it.
    slept = c.admin("POST", f"/admin/models/{MODEL}/sleep", params={"level": 1})
    assert slept["level"] == 1 and len(slept["replicas"]) == 2
    eventually(
        lambda: c.replica_states() == ["sleeping", "sleeping"], timeout=60, what="both replicas asleep"
    )
    c.wait_phase("Sleeping", timeout=120)
    woken = chat(c, [{"role": "user", "content": "Wake up, please"}])
    assert woken.prompt_tokens > 0
    eventually(lambda: c.replica_states() == ["awake", "awake"], timeout=120, what="the wake woke the fleet")

    # 7. Kill one engine's core process: its /health fails, the liveness probe restarts the container, the
    # model is Degraded while the replica reloads, then Ready again with both replicas.
    victim = c.engine_pods()[0]
    name = victim["metadata"]["name"]
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    killed = kubectl("-n", MODEL_NS, "exec", name, "-c", "engine", "--", "python", "-c", KILL_ENGINE_CORE)
    assert killed.split(), f"no engine core process found in {name}"
    c.phases.clear()
    c.wait_phase("Degraded", timeout=300)
    c.wait_phase("Ready", ready=2, timeout=STARTUP_S)
    assert "Degraded" in c.phases[:-1] and c.phases[-1] == "Ready", c.phases
    (again,) = [p for p in c.engine_pods() if p["metadata"]["name"] == name]
    assert again["status"]["containerStatuses"][0]["restartCount"] > restarts
    events = kubectl.json("-n", MODEL_NS, "get", "events", "--field-selector", f"involvedObject.name={MODEL}")
    assert any(e["type"] == "Warning" and name in e["message"] for e in events["items"])
    eventually(lambda: c.replica_states().count("awake") == 2, timeout=120, what="both replicas awake again")
    assert chat(c, [{"role": "user", "content": "Still there?"}]).prompt_tokens > 0

    # 8. Delete: the finalizer holds the model until its pods are gone and Redis is purged.
    pods = {p["metadata"]["name"] for p in c.engine_pods()}
    kubectl("-n", MODEL_NS, "delete", "im", MODEL, "--timeout=300s")
    assert c.engine_pods() == []
    assert kubectl("-n", MODEL_NS, "get", "deploy", MODEL, "--ignore-not-found", "-o", "name").strip() == ""

    def model_keys() -> list[str]:
        return [
            k for k in c.redis_keys()
            if f":model:{MODEL}:" in k or any(f":{p}#" in k or k.endswith(f":{p}") for p in pods)
        ]  # fmt: skip

    eventually(lambda: model_keys() == [], timeout=120, what="no Redis key of the model or its replicas")
    assert MODEL not in c.redis("SMEMBERS", "kvf:models").split()

    # The tenant goes too: its record, keys and usage; only its rate-limit windows remain, and they expire.
    kubectl("delete", "-f", str(EXAMPLES / "tenant.yaml"), "--timeout=120s")
    key_hash = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    left = [k for k in c.redis_keys() if TENANT in k or k == f"kvf:apikey:{key_hash}"]
    assert all(k.startswith(f"kvf:ratelimit:{TENANT}:") for k in left), left
    assert all(0 < int(c.redis("TTL", k)) <= 120 for k in left), left
