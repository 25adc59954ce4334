"""The admin API's tenant names and writes: the Tenant resource's naming rule, create-only creation (one
winner among concurrent creates), updates that never recreate, and tenants stored under older names.
A real gateway on real Redis (no replicas needed)."""

from __future__ import annotations

import threading

import httpx
import pytest

from kvfleet_common import redis_keys
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.schemas import TenantRecord, encode_json
from kvfleet_devkit.redis_server import RedisServer
from tests.gateway.gateway_harness import run_gateway


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture(scope="module")
def gw(redis_url, tmp_path_factory):
    with run_gateway(redis_url, tmp_path_factory.mktemp("admin")) as g:
        yield g


@pytest.fixture
def store(redis_url):
    r = FleetStore.from_url(redis_url)
    yield r
    r.close()


def authenticates(gw, key: str) -> bool:
    r = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code in (200, 401), r.text
    return r.status_code == 200


@pytest.mark.parametrize(
    "name", ["org/team", "Team-A", "team_a", "-team", "team-", "team..a", "a" * 64, "a." * 127 + "a", "tëam"]
)
def test_names_outside_the_tenant_resources_rule_are_refused(gw, name):
    r = gw.admin("POST", "/admin/tenants", json={"name": name})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "name" and r.json()["error"]["type"] == "invalid_request_error"
    assert name not in [t["name"] for t in gw.admin("GET", "/admin/tenants").json()]


@pytest.mark.parametrize("name", ["team-a", "team-a.prod", "0", "a" * 63 + "." + "b" * 63])
def test_every_valid_name_can_be_created_read_have_its_keys_revoked_and_be_deleted(gw, name):
    created = gw.admin("POST", "/admin/tenants", json={"name": name})
    assert created.status_code == 201, created.text
    assert gw.admin("GET", f"/admin/tenants/{name}").json()["key_ids"] == [created.json()["key_id"]]
    second = gw.admin("POST", f"/admin/tenants/{name}/keys").json()
    assert gw.admin("DELETE", f"/admin/tenants/{name}/keys/{created.json()['key_id']}").status_code == 200
    assert not authenticates(gw, created.json()["api_key"]) and authenticates(gw, second["api_key"])
    assert gw.admin("PATCH", f"/admin/tenants/{name}", json={"max_concurrent": 3}).status_code == 200
    assert gw.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    assert gw.admin("GET", f"/admin/tenants/{name}").status_code == 404
    assert not authenticates(gw, second["api_key"])


def test_concurrent_creates_of_one_name_make_one_tenant_with_one_key(gw, store):
    barrier, results = threading.Barrier(10), []

    def create(i: int) -> None:
        barrier.wait(30)
        results.append(gw.admin("POST", "/admin/tenants", json={"name": "contested", "priority": i}))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.status_code for r in results) == [201] + [409] * 9
    [won] = [r.json() for r in results if r.status_code == 201]
    for lost in (r.json() for r in results if r.status_code == 409):
        assert lost["error"]["code"] == "tenant_exists" and "api_key" not in lost
    assert list(store.list_api_keys("contested")) == [won["key_id"]]
    assert authenticates(gw, won["api_key"])
    assert gw.admin("DELETE", "/admin/tenants/contested").status_code == 200


def test_create_never_overwrites_and_patch_never_recreates(gw, store):
    first = gw.admin("POST", "/admin/tenants", json={"name": "keep", "requests_per_minute": 5}).json()
    overwrite = {"name": "keep", "requests_per_minute": 99, "cache_salt": ""}
    again = gw.admin("POST", "/admin/tenants", json=overwrite)
    assert again.status_code == 409
    kept = store.get_tenant("keep")
    assert kept.requests_per_minute == 5 and kept.cache_salt != ""  # nothing of the refused create landed
    assert authenticates(gw, first["api_key"])
    assert gw.admin("DELETE", "/admin/tenants/keep").status_code == 200
    r = gw.admin("PATCH", "/admin/tenants/keep", json={"requests_per_minute": 7})
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    assert store.get_tenant("keep") is None and "keep" not in [t.name for t in store.list_tenants()]


def test_the_operators_upsert_creates_and_replaces(store):
    assert store.upsert_tenant(TenantRecord(name="synced", requests_per_minute=1)) is True
    assert store.upsert_tenant(TenantRecord(name="synced", requests_per_minute=2)) is False
    assert store.get_tenant("synced").requests_per_minute == 2
    with pytest.raises(ValueError, match="invalid tenant name"):
        store.upsert_tenant(TenantRecord(name="org/synced"))
    assert store.delete_tenant("synced")


def test_a_tenant_stored_under_an_older_name_can_still_be_managed(gw, store):
    # written before names were checked (the record itself accepts it): the admin API used to answer 404
    # for every route of it, since "/" ended the path parameter
    legacy = TenantRecord(name="org/team", max_concurrent=2)
    store.client.set(redis_keys.tenant(legacy.name), encode_json(legacy))
    store.client.sadd(redis_keys.tenants(), legacy.name)
    first = gw.admin("POST", "/admin/tenants/org/team/keys")
    assert first.status_code == 201, first.text
    assert authenticates(gw, first.json()["api_key"])
    assert gw.admin("GET", "/admin/tenants/org/team").json()["max_concurrent"] == 2
    patched = gw.admin("PATCH", "/admin/tenants/org/team", json={"max_concurrent": 4})
    assert patched.status_code == 200 and patched.json()["max_concurrent"] == 4
    revoked = gw.admin("DELETE", f"/admin/tenants/org/team/keys/{first.json()['key_id']}")
    assert revoked.status_code == 200 and not authenticates(gw, first.json()["api_key"])
    assert gw.admin("DELETE", "/admin/tenants/org/team").status_code == 200
    assert gw.admin("GET", "/admin/tenants/org/team").status_code == 404
    assert store.client.keys("kvf:tenant:org/team*") == []
    assert "org/team" not in [t.name for t in store.list_tenants()]
