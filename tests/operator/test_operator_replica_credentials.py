"""Each model's engines get only their model's credentials (the operator's per-model Secret), never the
platform admin token; rotating the platform token changes nothing an engine sees."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from kvfleet_common.replica_credentials import engine_admin_token, model_key
from kvfleet_operator import manifests
from kvfleet_operator.spec import OperatorConfig, model_spec_from
from tests.operator.test_operator_manifests import engine_container, model_obj

ROOT = "ab" * 32
CONFIG = OperatorConfig(redis_url="redis://:pw@redis.kvfleet-system:6379/0", admin_token="platform-s3cret",
                        replica_key_root=ROOT)  # fmt: skip


def secret_data(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_engines_read_their_model_key_and_admin_token_from_the_model_secret():
    model = model_spec_from(model_obj(model={"uri": "pvc://models/llama", "servedName": "llama-chat"}))
    deployment = manifests.deployment(model, CONFIG)
    container = engine_container(deployment)
    env = {e["name"]: e for e in container["env"]}
    for name, key in (("KVFLEET_REPLICA_KEY", "replica-key"), ("KVFLEET_ADMIN_TOKEN", "admin-token"),
                      ("KVFLEET_REDIS_URL", "redis-url")):  # fmt: skip
        assert env[name] == {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": "llama-credentials", "key": key}},
        }
    assert "KVFLEET_REPLICA_KEY_ROOT" not in env  # the root never leaves the platform's namespace
    text = str(deployment)
    assert ROOT not in text and CONFIG.admin_token not in text  # no secret in the pod template

    key = model_key(bytes.fromhex(ROOT), "llama-chat")  # the served name: what heartbeats carry
    data = secret_data(manifests.credentials_secret(model, CONFIG))
    assert data == {
        "redis-url": CONFIG.redis_url,
        "replica-key": key.hex(),
        "admin-token": engine_admin_token(key),
    }
    assert CONFIG.admin_token not in data.values() and ROOT not in data.values()
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations[manifests.CREDENTIALS_HASH_ANNOTATION] == manifests.credentials_hash(
        manifests.credentials_secret(model, CONFIG))  # fmt: skip


def test_models_get_different_credentials():
    a = secret_data(manifests.credentials_secret(model_spec_from(model_obj()), CONFIG))
    other = model_obj()
    other["metadata"]["name"] = "qwen"
    b = secret_data(manifests.credentials_secret(model_spec_from(other), CONFIG))
    assert a["replica-key"] != b["replica-key"] and a["admin-token"] != b["admin-token"]


def test_rotating_the_platform_admin_token_changes_nothing_for_engines():
    model = model_spec_from(model_obj())
    rotated = dataclasses.replace(CONFIG, admin_token="a-new-platform-token")
    assert manifests.credentials_secret(model, rotated) == manifests.credentials_secret(model, CONFIG)
    assert manifests.deployment(model, rotated) == manifests.deployment(model, CONFIG)  # no restart


def test_a_new_root_rolls_the_engines_onto_new_keys():
    model = model_spec_from(model_obj())
    rerooted = dataclasses.replace(CONFIG, replica_key_root="cd" * 32)
    before, after = manifests.deployment(model, CONFIG), manifests.deployment(model, rerooted)
    key = manifests.CREDENTIALS_HASH_ANNOTATION
    assert before["spec"]["template"]["metadata"]["annotations"][key] != after["spec"]["template"]["metadata"]["annotations"][key]  # fmt: skip
    assert secret_data(manifests.credentials_secret(model, rerooted))["replica-key"] != secret_data(
        manifests.credentials_secret(model, CONFIG))["replica-key"]  # fmt: skip


def test_without_a_root_engines_get_the_platform_token_and_no_key():
    """Local development only (the operator warns at start): today's behaviour."""
    model = model_spec_from(model_obj())
    plain = dataclasses.replace(CONFIG, replica_key_root="")
    assert secret_data(manifests.credentials_secret(model, plain)) == {
        "redis-url": CONFIG.redis_url, "admin-token": CONFIG.admin_token,
    }  # fmt: skip
    env = {e["name"] for e in engine_container(manifests.deployment(model, plain))["env"]}
    assert "KVFLEET_REPLICA_KEY" not in env


def _template_annotation(model, config: OperatorConfig) -> str:
    return manifests.deployment(model, config)["spec"]["template"]["metadata"]["annotations"][
        manifests.CREDENTIALS_HASH_ANNOTATION
    ]


@pytest.mark.parametrize(
    ("change", "credentials_change"),
    [
        ({}, False),
        ({"redis_url": "redis://:rotated-pw@redis.kvfleet-system:6379/0"}, True),  # a Redis password rotation
        ({"redis_url": "redis://:pw@redis-2.kvfleet-system:6379/0"}, True),  # another Redis
        ({"replica_key_root": "cd" * 32}, True),  # a root rotation
        ({"admin_token": "a-new-platform-token"}, False),  # engines never hold it (with a root)
        ({"engine_image": "registry.test/other:2"}, False),  # rolls the pods through the spec, not this
        ({"otlp_endpoint": "http://collector:4318"}, False),
        ({"replica_key_root": ""}, True),  # no root: the platform token instead of the model's key and token
    ],
)
def test_the_template_names_new_credentials_iff_the_secret_changes(change, credentials_change):
    """The pod template's credentials hash changes exactly when the Secret the engines read does: a rotation
    rolls them (they read the Secret only at start), and nothing else does it through this annotation."""
    model = model_spec_from(model_obj())
    changed = dataclasses.replace(CONFIG, **change)
    secret = manifests.credentials_secret
    assert (secret(model, changed) != secret(model, CONFIG)) == credentials_change
    assert (_template_annotation(model, changed) != _template_annotation(model, CONFIG)) == credentials_change
    if not change:
        assert manifests.deployment(model, changed) == manifests.deployment(model, CONFIG)  # no roll at all


def test_without_a_root_rotating_the_platform_token_rolls_the_engines_that_hold_it():
    model = model_spec_from(model_obj())
    plain = dataclasses.replace(CONFIG, replica_key_root="")
    rotated = dataclasses.replace(plain, admin_token="a-new-platform-token")
    assert _template_annotation(model, plain) != _template_annotation(model, rotated)


def test_the_credentials_hash_reveals_none_of_the_credentials():
    """A fixed-length digest of all the data together (the 256-bit replica key included), so a reader of
    the Deployment can neither read a credential off it nor confirm a guess of the Redis password alone."""
    model = model_spec_from(model_obj())
    secret = manifests.credentials_secret(model, CONFIG)
    digest = manifests.credentials_hash(secret)
    assert len(digest) == 16 and int(digest, 16) >= 0  # 64 bits of a SHA-256: nothing to read a value off
    text = json.dumps(manifests.deployment(model, CONFIG))
    assert all(value not in text for value in [*secret_data(secret).values(), *secret["data"].values()])
    # the same Redis password with another model's key gives another digest: the key is part of the input
    other = model_obj()
    other["metadata"]["name"] = "qwen"
    assert manifests.credentials_hash(manifests.credentials_secret(model_spec_from(other), CONFIG)) != digest
