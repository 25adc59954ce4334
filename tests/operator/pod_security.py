"""The Pod Security Standards' "restricted" profile (Kubernetes 1.30+), checked on a pod spec as the API
server's PodSecurity admission checks it: every baseline control, then every restricted one. Plus the one
rule of this project beyond the profile: every container's root filesystem is read-only.

`restricted_violations(pod_spec, annotations)` returns one line per violation (empty: the pod passes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Baseline: capabilities a container may add.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# Restricted: the only volume types allowed.
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
    "secret",
}  # fmt: skip
VOLUME_META = {"name"}


def containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod.get(field) or []:
            yield f"{field}[{c.get('name')}]", c


def _baseline(pod: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("securityContext.windowsOptions.hostProcess must not be true")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} must not be true")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"volume {volume['name']}: hostPath is not allowed")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not a safe sysctl")
    contexts = [("pod", psc)] + [(where, c.get("securityContext") or {}) for where, c in containers(pod)]
    for where, sc in contexts:
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined is not allowed")
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: appArmorProfile must be RuntimeDefault or Localhost")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{where}: seLinuxOptions are restricted")
    for where, c in containers(pod):
        sc = c.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess must not be true")
        if sc.get("privileged"):
            out.append(f"{where}: privileged must not be true")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{where}: capabilities {sorted(added - BASELINE_CAPABILITIES)} may not be added")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount must be Default")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']} is not allowed")
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"annotation {key}: {value} is not an allowed AppArmor profile")
    return out


def _restricted(pod: dict[str, Any]) -> list[str]:
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - VOLUME_META
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: type {sorted(kinds)} is not allowed")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser must not be 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for where, c in containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost (pod or container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: only NET_BIND_SERVICE may be added")
    return out


def _read_only_root(pod: dict[str, Any]) -> list[str]:
    return [
        f"{where}: readOnlyRootFilesystem must be true"
        for where, c in containers(pod)
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True
    ]


def restricted_violations(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """What keeps ``pod`` (a PodSpec) out of a namespace enforcing "restricted", plus a writable root."""
    return _baseline(pod, annotations or {}) + _restricted(pod) + _read_only_root(pod)
