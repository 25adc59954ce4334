"""What the pod runner computes as a node and a Deployment controller would, as pure functions: pod names and
template hashes, ``$(VAR)`` expansion, the rollout budget, the downward API, status comparison; and the
translation of a container's args and env to a local process (container ports -> local ports, mount paths ->
local directories); and how often a probe runs. See ``podrunner`` for the whole picture.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

POD_IP = "127.0.0.1"
NODE_NAME = "local"
TEMPLATE_HASH_LABEL = "pod-template-hash"
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what Kubernetes uses for generated name suffixes
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(Exception):
    """The container cannot be started as specified (missing Secret key, unsupported field, ...): the
    kubelet's CreateContainerConfigError."""


def now_rfc3339() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def template_hash(template: Mapping[str, Any]) -> str:
    """A stable short hash of a pod template (the ``pod-template-hash`` label; part of every pod name)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    n = int.from_bytes(digest[:8], "big")
    out = []
    for _ in range(10):
        n, i = divmod(n, len(NAME_ALPHABET))
        out.append(NAME_ALPHABET[i])
    return "".join(out)


def pod_name(deployment: str, hash_: str) -> str:
    return f"{deployment}-{hash_}-{''.join(secrets.choice(NAME_ALPHABET) for _ in range(5))}"


def expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known variables are replaced, unknown references stay as they are,
    and ``$$`` is an escaped ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, value)


def resolve_int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    """``maxSurge`` / ``maxUnavailable``: an int, or a percentage of ``total`` (surge rounds up,
    unavailable rounds down, as the Deployment controller does)."""
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        exact = total * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def rollout_budget(deployment: Mapping[str, Any]) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) of a Deployment; both zero is impossible (unavailable becomes 1)."""
    spec = deployment.get("spec", {})
    desired = int(spec.get("replicas", 1))
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return 0, max(desired, 1)
    rolling = strategy.get("rollingUpdate") or {}
    surge = resolve_int_or_percent(rolling.get("maxSurge", "25%"), desired, round_up=True)
    unavailable = resolve_int_or_percent(rolling.get("maxUnavailable", "25%"), desired, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def rewrite_args(args: Sequence[str], ports: Mapping[int, int], mounts: Mapping[str, str]) -> list[str]:
    """The container's args for a local process: ``--port <containerPort>`` -> the local port,
    ``--host 0.0.0.0`` -> 127.0.0.1, mount paths -> local directories."""
    out: list[str] = []
    previous = ""
    for arg in args:
        if previous == "--port" and arg.isdigit() and int(arg) in ports:
            arg = str(ports[int(arg)])
        elif arg.startswith("--port=") and arg[7:].isdigit() and int(arg[7:]) in ports:
            arg = f"--port={ports[int(arg[7:])]}"
        elif previous == "--host" and arg in ("0.0.0.0", "::"):
            arg = POD_IP
        elif arg in ("--host=0.0.0.0", "--host=::"):
            arg = f"--host={POD_IP}"
        else:
            arg = rewrite_paths(arg, mounts)
        out.append(arg)
        previous = arg
    return out


def rewrite_env_value(value: str, ports: Mapping[int, int], mounts: Mapping[str, str]) -> str:
    for container_port, local in ports.items():
        value = re.sub(rf"{re.escape(POD_IP)}:{container_port}(?!\d)", f"{POD_IP}:{local}", value)
    return rewrite_paths(value, mounts)


def rewrite_paths(value: str, mounts: Mapping[str, str]) -> str:
    """Replace a mount path (longest first) where it starts ``value`` or follows ``=`` / ``:``, at a path
    boundary (``/models`` matches ``/models`` and ``/models/x``, never ``/modelsx``)."""
    for mount in sorted(mounts, key=len, reverse=True):
        pattern = rf"(^|(?<=[=:])){re.escape(mount.rstrip('/'))}(?=/|$|:)"
        replaced = re.sub(pattern, lambda _m, local=mounts[mount]: local, value)
        if replaced != value:
            return replaced
    return value


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's ``fieldRef.fieldPath`` for a local pod."""
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": NODE_NAME,
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", "default"),
        "status.podIP": POD_IP,
        "status.podIPs": POD_IP,
        "status.hostIP": POD_IP,
        "status.hostIPs": POD_IP,
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"unsupported fieldRef {path!r}")


def status_equal(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal apart from timestamps (which would otherwise make every report a change)."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("lastTransitionTime", "lastUpdateTime")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return a is not None and strip(dict(a)) == strip(dict(b))


def merge_condition_times(previous: Sequence[Mapping[str, Any]], current: list[dict[str, Any]]) -> None:
    """Keep ``lastTransitionTime`` where a condition's status did not flip (in place)."""
    before = {c.get("type"): c for c in previous}
    for cond in current:
        old = before.get(cond["type"])
        if old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime"):
            cond["lastTransitionTime"] = old["lastTransitionTime"]


@dataclass(slots=True)
class Probe:
    """A container probe with its period scaled to ``period`` while keeping its failure window
    (``failureThreshold × periodSeconds``) in seconds, so a fast-polling harness gives up no sooner."""

    kind: str  # startup | readiness | liveness
    spec: dict[str, Any]
    period: float
    failure_threshold: int
    timeout: float
    next_at: float = 0.0
    failures: int = 0

    @classmethod
    def from_spec(cls, kind: str, spec: dict[str, Any] | None, period: float | None) -> Probe | None:
        if not spec:
            return None
        template_period = float(spec.get("periodSeconds", 10))
        threshold = int(spec.get("failureThreshold", 3))
        use_period = template_period if period is None else min(period, template_period)
        window = threshold * template_period
        return cls(
            kind=kind,
            spec=spec,
            period=use_period,
            failure_threshold=max(1, math.ceil(window / use_period)),
            timeout=float(spec.get("timeoutSeconds", 1)),
        )
