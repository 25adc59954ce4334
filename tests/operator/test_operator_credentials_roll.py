"""Rotated credentials roll the engines; an operator restart with the same ones does not.

The operator for real (kopf against KMock's Kubernetes emulator, a real redis-server), restarted the way the
chart restarts it when its credentials change: with the Redis URL holding a new password (Redis itself
restarted with it), then with a new replica key root. Engine pods read the model's credentials Secret only at
start, so each rotation must change the Deployment's pod template (its credentials-hash annotation, which is
what makes the Deployment controller replace the pods), and nothing else in it.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from kvfleet_devkit.kube_emulator import KubeEmulator, eventually
from kvfleet_devkit.redis_server import RedisServer
from kvfleet_operator import manifests
from kvfleet_operator.runner import OperatorThread, RunArgs
from tests.operator.op_harness import operator_args

NS = "default"
NAME = "rolling"
MODEL = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/inferencemodels/{NAME}"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
SECRET = f"/api/v1/namespaces/{NS}/secrets/{NAME}-credentials"
WAIT_S = 30.0


@contextmanager
def running(args: RunArgs) -> Iterator[OperatorThread]:
    op = OperatorThread(args).start()
    try:
        yield op
    finally:
        op.stop()


def with_config(args: RunArgs, **changes: str) -> RunArgs:
    return dataclasses.replace(args, config=dataclasses.replace(args.config, **changes))


def template(kube: KubeEmulator) -> dict:
    deployment = kube.get(DEPLOYMENT)
    assert deployment is not None, "no Deployment yet"
    return deployment["spec"]["template"]


def credentials_hash(template_: dict) -> str:
    return template_["metadata"]["annotations"][manifests.CREDENTIALS_HASH_ANNOTATION]


def rolled_from(kube: KubeEmulator, previous: dict) -> dict | None:
    """The Deployment's template once it names other credentials than ``previous`` did."""
    now = template(kube)
    return now if credentials_hash(now) != credentials_hash(previous) else None


def without_credentials_hash(template_: dict) -> dict:
    out = copy.deepcopy(template_)
    del out["metadata"]["annotations"][manifests.CREDENTIALS_HASH_ANNOTATION]
    return out


def secret_value(kube: KubeEmulator, key: str) -> str:
    secret = kube.get(SECRET)
    assert secret is not None
    return base64.b64decode(secret["data"][key]).decode()


def test_rotations_roll_the_engines_and_a_restart_with_the_same_credentials_does_not(kube: KubeEmulator):
    redis = RedisServer(password="first-" + secrets.token_hex(8))
    redis.start()
    rotated_redis: RedisServer | None = None
    args = operator_args(kube.url, redis.url, peering=None)  # standalone: one operator at a time here
    try:
        with running(args):
            kube.post(
                f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/inferencemodels",
                {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceModel",
                 "metadata": {"name": NAME, "namespace": NS}, "spec": {"model": {"uri": f"pvc://models/{NAME}"}}},
            )  # fmt: skip
            first = eventually(lambda: template(kube), timeout=WAIT_S)
        assert secret_value(kube, manifests.CREDENTIALS_REDIS_KEY) == redis.url

        # The same credentials: a restarted operator re-applies everything (kopf's resume) and computes the
        # same template, so the Deployment controller would start no new pod. The Deployment is deleted first
        # so that the re-applied one is what gets compared.
        kube.delete(DEPLOYMENT)
        with running(args):
            assert eventually(lambda: template(kube), timeout=WAIT_S) == first

        # A Redis password rotation: Redis restarts with the new password, the operator gets the new URL.
        redis.stop()
        rotated_redis = RedisServer(port=redis.port, password="second-" + secrets.token_hex(8))
        rotated_redis.start()
        rotated = with_config(args, redis_url=rotated_redis.url)
        with running(rotated):
            second = eventually(lambda: rolled_from(kube, first), timeout=WAIT_S)
            assert secret_value(kube, manifests.CREDENTIALS_REDIS_KEY) == rotated_redis.url
        assert without_credentials_hash(second) == without_credentials_hash(first)  # nothing else changed
        assert redis.password not in str(second) and rotated_redis.password not in str(second)

        # A replica key root rotation: every model's key changes, so its engines must restart on the new one.
        old_key = secret_value(kube, manifests.CREDENTIALS_REPLICA_KEY)
        rerooted = with_config(rotated, replica_key_root=secrets.token_hex(32))
        with running(rerooted):
            third = eventually(lambda: rolled_from(kube, second), timeout=WAIT_S)
            assert secret_value(kube, manifests.CREDENTIALS_REPLICA_KEY) != old_key
            assert credentials_hash(third) != credentials_hash(first)
            assert without_credentials_hash(third) == without_credentials_hash(first)
            kube.delete(MODEL)  # the finalizer needs a running operator
            eventually(lambda: kube.get(MODEL) is None, timeout=WAIT_S)
    finally:
        redis.close()
        if rotated_redis is not None:
            rotated_redis.close()
