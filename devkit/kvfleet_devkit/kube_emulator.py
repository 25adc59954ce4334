"""A Kubernetes API for tests, benchmarks and the local platform: KMock's `KubernetesEmulator` (stateful, over
real HTTP) in a background thread, with every resource the operator, kopf and kubectl touch registered for
discovery.

The emulator stores objects and streams watch events; it does not validate, default, garbage-collect or run
controllers. Tests play the Deployment controller by patching ``status`` themselves.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp.web
import httpx
import kmock
from kmock._internal import parsing as _kmock_parsing
from kmock._internal.enums import action as _action

T = TypeVar("T")


def _parse_path_with_namespaces(path: str, _original=_kmock_parsing.parse_path):
    """KMock 0.8 reads ``/api/v1/namespaces[/NAME]`` as a namespaced URL with no resource (and fails with
    a 500), so the Namespace resource itself is unreachable. Treat those paths as the ``namespaces``
    resource and defer to KMock for everything else."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or parts[4] in ("status", "finalize")):
        name = parts[3] if len(parts) >= 4 else None
        sub = parts[4] if len(parts) >= 5 else None
        return _kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _original(path)


_kmock_parsing.parse_path = _parse_path_with_namespaces

# resource -> discovery info
RESOURCES: dict[str, dict[str, Any]] = {
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status", "scale"}},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "kopf.dev/v1/clusterkopfpeerings": {"kind": "ClusterKopfPeering", "namespaced": False},
    "kopf.dev/v1/kopfpeerings": {"kind": "KopfPeering", "namespaced": True},
    "kvfleet.io/v1alpha1/inferencemodels": {
        "kind": "InferenceModel",
        "namespaced": True,
        "singular": "inferencemodel",
        "shortnames": {"im"},
        "subresources": {"status", "scale"},
    },
    "kvfleet.io/v1alpha1/tenants": {
        "kind": "Tenant",
        "namespaced": False,
        "singular": "tenant",
        "shortnames": {"kvt"},
        "subresources": {"status"},
    },
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


class ServerFieldsEmulator(kmock.KubernetesEmulator):
    """KMock's emulator plus the metadata a real API server maintains and clients rely on: ``uid``,
    ``creationTimestamp``, a ``resourceVersion`` that changes on every write (kopf guards its
    JSON-patches with a test on it), a ``generation`` that counts spec changes, and names from
    ``generateName`` (kopf's Events use it)."""

    _versions = itertools.count(1)
    _last_version = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Namespaces whose Secrets the client may not touch: every request for them is answered 403, as an
        # API server answers an operator whose RBAC does not reach there.
        self.forbidden_secret_namespaces: set[str] = set()

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    async def _serve_list(self, request):  # type: ignore[override]
        result = await super()._serve_list(request)
        result["metadata"]["resourceVersion"] = str(self._last_version)
        # kubectl decodes lists by their kind.
        info = self._resources.get(request.resource)
        if info is not None and info.kind:
            group, version = request.resource.group, request.resource.version
            result["apiVersion"] = f"{group}/{version}" if group else version
            result["kind"] = f"{info.kind}List"
        return result

    async def _serve_version(self, request):  # type: ignore[override]
        # Discovery as kubectl needs it: "v1" (not "/v1") for the core group, and subresources that
        # carry no short names (else `kubectl get im` is ambiguous) with the scale subresource's real
        # kind (autoscaling/v1 Scale, which `kubectl scale` decodes).
        result = await super()._serve_version(request)
        result["groupVersion"] = result["groupVersion"].lstrip("/")
        for entry in result["resources"]:
            if "/" in entry["name"]:
                entry["shortNames"] = []
                entry["singularName"] = ""
                entry["verbs"] = ["get", "patch", "update"]
                if entry["name"].endswith("/scale"):
                    entry.update(group="autoscaling", version="v1", kind="Scale")
        return result

    def _scale_of(self, request) -> dict:
        obj = self._objects[(request.resource, request.namespace, request.name)]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                "name": request.name,
                "namespace": request.namespace,
                "resourceVersion": obj.get("metadata", {}).get("resourceVersion"),
            },
            "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
            "status": {
                "replicas": obj.get("status", {}).get("replicas", 0),
                "selector": obj.get("status", {}).get("selector", ""),
            },
        }

    async def _serve_watch(self, request):  # type: ignore[override]
        # KMock replays every existing object at the start of a watch; a client that watches from the
        # resourceVersion of its list (kopf does) must not see those objects added a second time.
        since = request.params.get("resourceVersion", "")
        since = int(since) if since.isdigit() else 0
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and event.get("type") == "ADDED":
                version = str(event["object"].get("metadata", {}).get("resourceVersion", ""))
                if version.isdigit() and int(version) <= since:
                    continue
            yield event

    async def _handle(self, request):  # type: ignore[override]
        # KMock keeps every request for assertions and re-filters all of them on each new request to pick
        # a reaction (quadratic); a long-running emulator keeps only the request being served.
        del self._requests[:-1]
        if (
            request.resource is not None
            and request.resource.plural == "secrets"
            and request.namespace in self.forbidden_secret_namespaces
        ):
            raise kmock.KubernetesError(
                status=403,
                reason="Forbidden",
                message=f'secrets is forbidden: cannot access resource "secrets" in "{request.namespace}"',
            )
        data = request.data
        if request.resource is not None and request.action == _action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta["resourceVersion"] = self._next_version()
            meta["generation"] = 1
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
        elif request.resource is not None and request.action == _action.UPDATE and data is not None:
            key = (request.resource, request.namespace, request.name)
            current = self._objects[key] if key in self._objects else None  # noqa: SIM401 - no .get()
            generation = 0
            if current is not None and not current.deleted:
                generation = int(current.get("metadata", {}).get("generation", 0) or 0)
            version = self._next_version()
            if isinstance(data, dict):
                touches_spec = "spec" in data and request.subresource != "status"
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if touches_spec:
                    meta["generation"] = generation + 1
            elif isinstance(data, list):  # JSON patch
                # A failed "test" op is a conflict (422), which clients such as kopf handle by retrying later.
                for op in data:
                    if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" and current:
                        actual = current.get("metadata", {}).get("resourceVersion")
                        if actual != op.get("value"):
                            raise kmock.KubernetesError(
                                status=422,
                                reason="Invalid",
                                message=f"resourceVersion is {actual}, not {op['value']}",
                            )
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
                if any(str(op.get("path", "")).startswith("/spec") for op in data):
                    data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})
        response = await super()._handle(request)
        # The scale subresource speaks autoscaling/v1 Scale (a PATCH of {"spec": {"replicas": N}} was
        # merged into the object itself above, which matches specReplicasPath .spec.replicas).
        if (
            request.subresource == "scale"
            and request.action in (_action.FETCH, _action.UPDATE)
            and response.status < 300
        ):
            return aiohttp.web.json_response(self._scale_of(request))
        return response


class KubeEmulator:
    """``url`` serves the Kubernetes API; ``get/post/patch/delete`` are plain HTTP calls against it."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="kube-emulator", daemon=True)
        self.url = ""
        self.handler: kmock.KubernetesEmulator | None = None
        self.client: httpx.Client | None = None

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        async with ServerFieldsEmulator() as handler, kmock.Server(handler) as server:
            for resource, info in RESOURCES.items():
                handler.resources[resource] = kmock.ResourceInfo(
                    kind=info["kind"],
                    namespaced=info["namespaced"],
                    singular=info.get("singular", info["kind"].lower()),
                    shortnames=info.get("shortnames", set()),
                    subresources=info.get("subresources", set()),
                    verbs=VERBS,
                )
            self.handler = handler
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stopped.wait()

    def start(self) -> KubeEmulator:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the emulator did not start")
        self.client = httpx.Client(base_url=self.url, timeout=10)
        for ns in ("default", "kvfleet-system"):
            self.post(
                "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            )
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)

    # ---- plain HTTP against the emulator --------------------------------------------------------------

    def get(self, path: str) -> dict[str, Any] | None:
        assert self.client is not None
        resp = self.client.get(path)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def list(self, path: str) -> list[dict[str, Any]]:
        return (self.get(path) or {}).get("items", [])

    def post(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        resp = self.client.post(path, json=obj)
        resp.raise_for_status()
        return resp.json()

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        resp = self.client.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})
        resp.raise_for_status()
        return resp.json()

    def delete(self, path: str) -> None:
        assert self.client is not None
        self.client.delete(path).raise_for_status()

    def forbid_secrets(self, namespace: str, forbidden: bool = True) -> None:
        """Answer 403 to every request for Secrets in ``namespace`` (or stop doing so)."""
        assert self.handler is not None
        target = self.handler.forbidden_secret_namespaces  # type: ignore[attr-defined]
        if forbidden:
            target.add(namespace)
        else:
            target.discard(namespace)

    def events_for(self, name: str, namespace: str = "default") -> list[dict[str, Any]]:
        return [
            e
            for e in self.list(f"/api/v1/namespaces/{namespace}/events")
            if e.get("involvedObject", {}).get("name") == name
        ]


def eventually(check: Callable[[], T], timeout: float = 15.0, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns a truthy value without raising AssertionError; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
            error: Exception | None = None
        except AssertionError as e:
            error = e
        if time.monotonic() > deadline:
            if error is not None:
                raise error
            raise AssertionError(f"condition not met within {timeout} s (last result {result!r})")
        time.sleep(interval)
