"""Unit tests of the pure manifest builders: every field the engine pods depend on, no server involved."""

from __future__ import annotations

import base64
import copy
import json

import pytest

from kvfleet_operator import manifests
from kvfleet_operator.spec import OperatorConfig, model_spec_from, parse_model_uri
from kvfleet_operator.validation import SpecError
from tests.operator.test_operator_engine_fields import FULL_ENGINE

CONFIG = OperatorConfig(
    engine_image="registry.example/kvfleet-engine:1.0",
    engine_image_cpu="registry.example/kvfleet-engine-cpu:1.0",
    redis_url="redis://redis.kvfleet-system:6379/0",
    admin_token="s3cret",
)


def model_obj(**spec) -> dict:
    base = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 3},
        "spec": {"model": {"uri": "pvc://models/llama-3-8b"}},
    }
    base["spec"].update(spec)
    return base


def engine_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_gpu_deployment_requests_tp_times_pp_gpus_and_passes_parallel_flags():
    model = model_spec_from(
        model_obj(
            replicas=3, engine={"tensorParallelSize": 4, "pipelineParallelSize": 2, "dtype": "bfloat16"}
        )
    )
    dep = manifests.deployment(model, CONFIG)
    container = engine_container(dep)
    assert dep["spec"]["replicas"] == 3
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert container["command"] == ["kvfleet", "engine", "serve"]
    args = container["args"]
    assert flag(args, "--tensor-parallel-size") == "4"
    assert flag(args, "--pipeline-parallel-size") == "2"
    assert flag(args, "--device") == "cuda"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--model") == "/models/llama-3-8b"
    assert flag(args, "--served-model-name") == "llama"
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000"
    assert container["image"] == CONFIG.engine_image
    # GPU rollouts never surge: a surge pod would wait for the GPU the old pod holds.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    tolerations = dep["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_cpu_model_has_no_gpu_and_uses_cpu_image():
    model = model_spec_from(
        model_obj(accelerator="cpu", resources={"requests": {"cpu": "2", "memory": "4Gi"}})
    )
    dep = manifests.deployment(model, CONFIG)
    container = engine_container(dep)
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert flag(container["args"], "--device") == "cpu"
    assert container["image"] == CONFIG.engine_image_cpu
    assert "tolerations" not in dep["spec"]["template"]["spec"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_optional_engine_flags_map_one_to_one():
    model = model_spec_from(
        model_obj(
            engine={
                "maxModelLen": 4096,
                "maxNumSeqs": 64,
                "maxNumBatchedTokens": 2048,
                "blockSize": 32,
                "kvCacheMemory": "2Gi",
                "enablePrefixCaching": False,
                "seed": 7,
                "extraArgs": ["--attention-backend", "torch"],
            }
        )
    )
    args = manifests.engine_args(model)
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--max-num-seqs") == "64"
    assert flag(args, "--max-num-batched-tokens") == "2048"
    assert flag(args, "--block-size") == "32"
    assert flag(args, "--kv-cache-memory-bytes") == str(2 * 2**30)
    assert flag(args, "--seed") == "7"
    assert "--no-enable-prefix-caching" in args
    assert "--gpu-memory-utilization" not in args
    assert args[-2:] == ["--attention-backend", "torch"]


def test_defaults_leave_optional_flags_to_the_engine():
    args = manifests.engine_args(model_spec_from(model_obj(engine={"gpuMemoryUtilization": 0.85})))
    for absent in (
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-memory-bytes",
    ):
        assert absent not in args
    assert flag(args, "--gpu-memory-utilization") == "0.85"
    assert "--no-enable-prefix-caching" not in args
    assert flag(args, "--block-size") == "16"


def test_secrets_travel_in_env_not_argv_and_downward_api_names_the_replica():
    model = model_spec_from(model_obj(engine={"env": [{"name": "HF_TOKEN", "value": "x"}]}))
    container = engine_container(manifests.deployment(model, CONFIG))
    assert not any(CONFIG.admin_token in a or "redis://" in a for a in container["args"])
    env = {e["name"]: e for e in container["env"]}
    assert env["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "llama-credentials",
        "key": "redis-url",
    }
    assert env["KVFLEET_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    assert env["KVFLEET_REPLICA_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KVFLEET_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["KVFLEET_BASE_URL"]["value"] == "http://$(KVFLEET_POD_IP):8000"
    assert env["HF_TOKEN"]["value"] == "x"
    # $(VAR) expansion only sees variables defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert names.index("KVFLEET_POD_IP") < names.index("KVFLEET_BASE_URL")

    secret = manifests.credentials_secret(model, CONFIG)
    assert base64.b64decode(secret["data"]["redis-url"]).decode() == CONFIG.redis_url
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == CONFIG.admin_token


def test_probes_give_a_slow_model_load_its_full_startup_timeout():
    model = model_spec_from(model_obj(startupTimeoutSeconds=3600, terminationGracePeriodSeconds=300))
    dep = manifests.deployment(model, CONFIG)
    container = engine_container(dep)
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    # The engine's drain fits inside the grace period.
    assert flag(container["args"], "--shutdown-timeout") == "290"
    short = model_spec_from(model_obj(terminationGracePeriodSeconds=6))
    assert flag(manifests.engine_args(short), "--shutdown-timeout") == "3"
    assert dep["spec"]["progressDeadlineSeconds"] > 3600


def test_model_sources_mount_where_the_engine_reads():
    pvc = manifests.deployment(model_spec_from(model_obj()), CONFIG)["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pvc[
        "volumes"
    ]
    assert "initContainers" not in pvc

    hf_model = model_spec_from(model_obj(model={"uri": "hf://Qwen/Qwen2.5-0.5B@v1.0"}))
    hf = manifests.deployment(hf_model, CONFIG)["spec"]["template"]["spec"]
    (fetch,) = hf["initContainers"]
    assert fetch["command"] == [
        "hf",
        "download",
        "Qwen/Qwen2.5-0.5B",
        "--local-dir",
        "/models/hf",
        "--revision",
        "v1.0",
    ]
    assert flag(engine_container({"spec": {"template": {"spec": hf}}})["args"], "--model") == "/models/hf"
    assert {"name": "model", "emptyDir": {}} in hf["volumes"]

    file_model = model_spec_from(model_obj(model={"uri": "file:///opt/models/tiny/"}))
    spec = manifests.deployment(file_model, CONFIG)["spec"]["template"]["spec"]
    assert (
        flag(engine_container({"spec": {"template": {"spec": spec}}})["args"], "--model")
        == "/opt/models/tiny"
    )
    assert not any(v["name"] == "model" for v in spec["volumes"])


@pytest.mark.parametrize(
    "uri, message",
    [
        ("s3://bucket/model", "unknown scheme"),
        ("llama", "no scheme"),
        ("pvc://Bad_Claim/x", "not a PersistentVolumeClaim name"),
        ("pvc://claim/../etc", "'..'"),
        ("hf://just-a-name", "hf://org/name"),
        ("hf://org/name@", "empty revision"),
        ("file://relative/path", "absolute"),
    ],
)
def test_bad_model_uris_are_rejected_with_a_reason(uri, message):
    with pytest.raises(SpecError, match=message):
        parse_model_uri(uri)


def test_every_child_is_owned_labelled_and_named_after_the_model():
    model = model_spec_from(model_obj())
    objs = manifests.children(model, CONFIG)
    assert [o["kind"] for o in objs] == [
        "Secret",
        "ConfigMap",
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["labels"]["kvfleet.io/model"] == "llama"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceModel",
            "name": "llama",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    selector = manifests.selector_labels(model)
    dep = objs[-1]
    assert dep["spec"]["selector"]["matchLabels"] == selector
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    svc, pdb = objs[2], objs[3]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == selector
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert manifests.selector_string(model) == "app.kubernetes.io/component=engine,kvfleet.io/model=llama"


def test_config_map_describes_the_model_and_a_change_rolls_the_pods():
    model = model_spec_from(model_obj(sleep={"idleSeconds": 300}, access={"tenants": ["team-a"]}))
    doc = json.loads(manifests.config_map(model, CONFIG)["data"]["model.json"])
    assert doc["servedName"] == "llama"
    assert doc["sleep"] == {"idleSeconds": 300, "level": 1}
    assert doc["allowedTenants"] == ["team-a"]
    assert doc["routingPolicy"] == "prefix-aware"
    assert doc["engineArgs"] == manifests.engine_args(model)

    before = manifests.deployment(model, CONFIG)["spec"]["template"]["metadata"]["annotations"]
    changed = model_spec_from(model_obj(sleep={"idleSeconds": 60}, access={"tenants": ["team-a"]}))
    after = manifests.deployment(changed, CONFIG)["spec"]["template"]["metadata"]["annotations"]
    assert before[manifests.CONFIG_HASH_ANNOTATION] != after[manifests.CONFIG_HASH_ANNOTATION]


def test_builders_are_pure_and_share_no_objects():
    obj = model_obj(engine={"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]})
    snapshot = copy.deepcopy(obj)
    model = model_spec_from(obj)
    first = manifests.children(model, CONFIG)
    second = manifests.children(model, CONFIG)
    assert first == second
    assert obj == snapshot
    # Mutating one rendering must not leak into the next (no shared nested dicts).
    engine_container(first[-1])["env"][-1]["valueFrom"]["secretKeyRef"]["name"] = "changed"
    assert (
        engine_container(manifests.deployment(model, CONFIG))["env"][-1]["valueFrom"]["secretKeyRef"]["name"]
        == "s"
    )


def test_rendered_arguments_parse_with_the_engines_own_command_line():
    """Contract with `kvfleet engine serve`: the flags the operator sets itself (model path, address, served
    name, device, shutdown timeout) exist and mean the same."""
    server_cli = pytest.importorskip("kvfleet_engine.server.serve_cli")
    model = model_spec_from(
        model_obj(
            engine=FULL_ENGINE,
            model={"uri": "pvc://models/llama", "servedName": "org/llama"},
        )
    )
    args = server_cli.build_parser().parse_args(manifests.engine_args(model))
    assert (args.model, args.host, args.port, args.served_model_name) == (
        "/models/llama",
        "0.0.0.0",
        8000,
        "org/llama",
    )
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.device) == (2, 2, "cuda")
    # The engine settings themselves parse back to the spec's values: test_operator_engine_fields.py.
    assert args.shutdown_timeout == 110.0

    cpu = model_spec_from(model_obj(accelerator="cpu", engine={"kvCacheMemory": "1Gi"}))
    args = server_cli.build_parser().parse_args(manifests.engine_args(cpu))
    assert args.device == "cpu" and args.kv_cache_memory_bytes == 2**30 and args.enable_prefix_caching is True
    assert args.enforce_eager is False
