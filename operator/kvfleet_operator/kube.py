"""A thin async client for the few Kubernetes API calls the operator makes itself (kopf does the watching).

It authenticates with the same `kopf.ConnectionInfo` kopf logged in with, so both always talk to the same
cluster with the same identity. Objects are applied with server-side apply (field manager
``kvfleet-operator``, forced): the operator owns exactly the fields it renders, and users or other
controllers may own the rest (e.g. an HPA owning ``replicas`` is not fought over).
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from kvfleet_operator.manifests import MANAGER

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")

# kind -> (plural, namespaced) for every kind the operator reads or writes.
KINDS: dict[str, tuple[str, bool]] = {
    "Deployment": ("deployments", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
    "Secret": ("secrets", True),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "NetworkPolicy": ("networkpolicies", True),
    "Pod": ("pods", True),
    "InferenceModel": ("inferencemodels", True),
    "Tenant": ("tenants", False),
    "ClusterKopfPeering": ("clusterkopfpeerings", False),
    "KopfPeering": ("kopfpeerings", True),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def object_path(
    api_version: str, kind: str, namespace: str | None = None, name: str | None = None, subresource: str = ""
) -> str:
    """REST path of an object (or of its collection when ``name`` is None)."""
    plural, namespaced = KINDS[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced:
        if not namespace:
            raise ValueError(f"{kind} is namespaced: a namespace is required")
        base += f"/namespaces/{quote(namespace, safe='')}"
    path = f"{base}/{plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    if subresource:
        path += f"/{subresource}"
    return path


def path_of(obj: dict[str, Any], subresource: str = "") -> str:
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)


@dataclass(slots=True)
class _Auth:
    headers: dict[str, str]
    ssl: ssl.SSLContext | bool
    token_file: Path | None


def _auth_from(info: kopf.ConnectionInfo) -> _Auth:
    headers: dict[str, str] = {}
    if info.token:
        headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
    elif info.username and info.password:
        headers["Authorization"] = aiohttp.BasicAuth(info.username, info.password).encode()
    context: ssl.SSLContext | bool
    if info.server.startswith("http://") or info.insecure:
        context = False
    else:
        context = ssl.create_default_context()
        if info.ca_path:
            context.load_verify_locations(cafile=os.fsdecode(info.ca_path))
        elif info.ca_data:
            ca = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
            context.load_verify_locations(cadata=ca)
        cert, key = info.certificate_path, info.private_key_path
        if info.certificate_data and info.private_key_data:
            cert, key = _temp_file(info.certificate_data), _temp_file(info.private_key_data)
        if cert and key:
            context.load_cert_chain(os.fsdecode(cert), os.fsdecode(key))
    # In a pod the kubelet rotates the projected token: re-read it per request instead of caching it.
    token_file = SERVICE_ACCOUNT_TOKEN if info.token and SERVICE_ACCOUNT_TOKEN.exists() else None
    return _Auth(headers=headers, ssl=context, token_file=token_file)


def _temp_file(data: str | bytes) -> str:
    with tempfile.NamedTemporaryFile(delete=False, prefix="kvfleet-kube-") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        return f.name


class KubeClient:
    """Async REST calls against one API server. Create inside the running event loop."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout: float = 30.0) -> None:
        self.server = info.server.rstrip("/")
        self._auth = _auth_from(info)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", **self._auth.headers}
        if self._auth.token_file is not None:
            headers["Authorization"] = f"Bearer {self._auth.token_file.read_text().strip()}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._session.request(
            method, self.server + path, data=data, headers=headers, params=params, ssl=self._auth.ssl
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except (ValueError, AttributeError):
                    message = text
                raise KubeError(resp.status, str(message)[:2000])
            return json.loads(text) if text else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return await self.request("GET", path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self.request("GET", path, params=params)).get("items", [])

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` as the operator's field manager (creating it if needed)."""
        params = {"fieldManager": MANAGER, "force": "true"}
        try:
            return await self.request(
                "PATCH", path_of(obj), obj, content_type="application/apply-patch+yaml", params=params
            )
        except KubeError as e:
            # A real API server creates on apply; simpler API servers (the test emulator) answer 404.
            if e.status != 404:
                raise
        collection = object_path(obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace"))
        return await self.request("POST", collection, obj, params={"fieldManager": MANAGER})

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(self, path: str) -> bool:
        """Delete (background propagation); False if it was already gone."""
        try:
            await self.request("DELETE", path, {"propagationPolicy": "Background"})
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise
