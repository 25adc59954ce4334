"""Reconcile latency of the kvfleet operator: InferenceModel created -> its Deployment exists.

The Kubernetes API is KMock's emulator (in this process, over HTTP), Redis a real redis-server, and the
operator the real `kvfleet operator` command in its own process (kopf, standalone). Baseline measured in the
same run: one bare API round trip (POST + GET of a ConfigMap), the floor any controller pays twice.

    .venv/bin/python -m bench.operator [--sequential 30] [--burst 50]

Prints a table and writes bench/results/operator.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import default_out, loadavg, log, print_table, write_json
from kvfleet_devkit.kube_emulator import KubeEmulator
from kvfleet_devkit.redis_server import RedisServer

NS = "default"
MODELS = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/inferencemodels"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
POLL_S = 0.002


def model(name: str) -> dict:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"uri": f"pvc://models/{name}"},
            "replicas": 2,
            "engine": {"tensorParallelSize": 2},
        },
    }


def wait_for(check, timeout: float = 60.0) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("the operator did not react in time")
        time.sleep(POLL_S)
    return time.perf_counter()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequential", type=int, default=30, help="models created one at a time")
    p.add_argument("--burst", type=int, default=50, help="models created back to back")
    p.add_argument("--baseline-reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=default_out("operator"))
    args = p.parse_args(argv)

    load_before = loadavg()
    redis = RedisServer()
    redis.start()
    kube = KubeEmulator().start()
    log_file = tempfile.NamedTemporaryFile("w", prefix="kvfleet-operator-", suffix=".log", delete=False)  # noqa: SIM115
    operator = subprocess.Popen(
        [sys.executable, "-m", "kvfleet_cli.main", "operator", f"--server={kube.url}",
         "--standalone", "--idle-check-seconds=3600", "--resync-seconds=3600"],
        stdout=log_file, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVFLEET_REDIS_URL": redis.url},  # its password: not in ps
    )  # fmt: skip
    try:
        # Warm-up: kopf's discovery and watch streams, the operator's clients.
        kube.post(MODELS, model("warmup"))
        wait_for(lambda: kube.get(f"{DEPLOYMENTS}/warmup") is not None, timeout=120)

        baseline: list[float] = []
        for i in range(args.baseline_reps):
            t0 = time.perf_counter()
            kube.post(
                f"/api/v1/namespaces/{NS}/configmaps",
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"rtt-{i}", "namespace": NS}},
            )
            kube.get(f"/api/v1/namespaces/{NS}/configmaps/rtt-{i}")
            baseline.append((time.perf_counter() - t0) * 1000)

        log(f"sequential: {args.sequential} models")
        to_deployment: list[float] = []
        to_status: list[float] = []
        for i in range(args.sequential):
            name = f"seq-{i}"
            t0 = time.perf_counter()
            kube.post(MODELS, model(name))
            t_dep = wait_for(lambda n=name: kube.get(f"{DEPLOYMENTS}/{n}") is not None)
            t_st = wait_for(
                lambda n=name: (kube.get(f"{MODELS}/{n}") or {}).get("status", {}).get("servedName")
            )
            to_deployment.append((t_dep - t0) * 1000)
            to_status.append((t_st - t0) * 1000)

        log(f"burst: {args.burst} models")
        t0 = time.perf_counter()
        for i in range(args.burst):
            kube.post(MODELS, model(f"burst-{i}"))
        t_posted = time.perf_counter()
        want = {f"burst-{i}" for i in range(args.burst)}
        t_all = wait_for(lambda: want <= {d["metadata"]["name"] for d in kube.list(DEPLOYMENTS)}, timeout=600)
        burst_s = t_all - t0
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
        kube.stop()
        redis.close()
        log_file.close()

    rows = [
        ["API round trip (POST + GET), baseline", statistics.median(baseline), pct(baseline, 0.9), max(baseline), "1.0×"],
        ["create → Deployment exists", statistics.median(to_deployment), pct(to_deployment, 0.9), max(to_deployment),
         f"{statistics.median(to_deployment) / statistics.median(baseline):.1f}×"],
        ["create → status written", statistics.median(to_status), pct(to_status, 0.9), max(to_status),
         f"{statistics.median(to_status) / statistics.median(baseline):.1f}×"],
    ]  # fmt: skip
    print_table(
        f"Operator reconcile latency, ms ({args.sequential} models one at a time)",
        ["measure", "p50 ms", "p90 ms", "max ms", "p50 vs baseline"],
        rows,
        notes=[
            f"burst: {args.burst} models posted in {(t_posted - t0) * 1000:.0f} ms; all {args.burst} Deployments "
            f"exist after {burst_s:.2f} s ({args.burst / burst_s:.1f} models/s)",
            "each model owns 5 objects (Secret, ConfigMap, Service, PDB, Deployment), applied in order, "
            "after kopf has added its finalizer (one extra write and watch event)",
        ],
    )
    write_json(
        args.out,
        {
            "benchmark": "operator_reconcile_latency",
            "command": " ".join([".venv/bin/python", "-m", "bench.operator", *(argv if argv is not None else sys.argv[1:])]),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "baseline_roundtrip_ms": {"p50": statistics.median(baseline), "p90": pct(baseline, 0.9), "samples": baseline},
            "create_to_deployment_ms": {
                "p50": statistics.median(to_deployment), "p90": pct(to_deployment, 0.9), "max": max(to_deployment),
                "samples": to_deployment,
            },
            "create_to_status_ms": {
                "p50": statistics.median(to_status), "p90": pct(to_status, 0.9), "max": max(to_status),
                "samples": to_status,
            },
            "burst": {"models": args.burst, "seconds_until_all_deployments": burst_s,
                      "models_per_second": args.burst / burst_s},
        },
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
