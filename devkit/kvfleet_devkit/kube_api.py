"""Plain JSON over HTTP against a Kubernetes API server without auth (the local emulator), and the paths of the
objects the pod runner reads and writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx


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
