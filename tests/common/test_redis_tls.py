"""``rediss://`` end to end in the Python clients: a redis-server speaking only TLS (certificate from a private
CA made here with openssl) and requiring a password; the sync and the async fleet stores connect with the CA
named in the URL's query (``ssl_ca_certs``), exactly as the components' ``--redis-url`` would, and the
start-up credentials check works over TLS too. Without the CA the connection is refused."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.exceptions

from kvfleet_common.fleet_store.store import AsyncFleetStore, FleetStore
from kvfleet_common.redis_url import RedisCredentialsError, check_credentials
from kvfleet_devkit.processes import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("openssl") is None,
    reason="needs redis-server and openssl",
)
PASSWORD = "tls-test-password"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory) -> Iterator[tuple[int, Path]]:
    """(TLS port, CA file) of a redis-server with TLS only (its plain port off) and a password."""
    d = tmp_path_factory.mktemp("redis-tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvfleet test CA",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
             "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-extfile", "san.ext", "-out", "server.crt", cwd=d)  # fmt: skip
    port = free_port()
    config = d / "redis.conf"
    config.write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {d / 'server.crt'}\n"
        f"tls-key-file {d / 'server.key'}\ntls-ca-cert-file {d / 'ca.crt'}\ntls-auth-clients no\n"
        f'save ""\nappendonly no\ndir {d}\nrequirepass {PASSWORD}\n'
    )
    os.chmod(config, 0o600)
    with (d / "redis.log").open("wb") as log:
        proc = subprocess.Popen(["redis-server", str(config)], stdout=log, stderr=subprocess.STDOUT, cwd=d)
    try:
        client = redis.Redis(port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(d / "ca.crt"))
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None:
                    pytest.skip(f"this redis-server cannot serve TLS: {(d / 'redis.log').read_text()[-500:]}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        yield port, d / "ca.crt"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_fleet_stores_connect_over_tls_with_the_ca_from_the_url(tls_redis):
    port, ca = tls_redis
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    store = FleetStore.from_url(url)
    try:
        assert store.client.ping()
        assert store.list_models() == []
    finally:
        store.close()

    async def use_async() -> list[str]:
        async_store = AsyncFleetStore.from_url(url)
        try:
            return await async_store.list_models()
        finally:
            await async_store.aclose()

    assert asyncio.run(use_async()) == []
    assert check_credentials(url) is True
    with pytest.raises(RedisCredentialsError, match=r"rediss://:\*\*\*@127\.0\.0\.1"):
        check_credentials(url.replace(PASSWORD, "wrong"))


def test_tls_without_the_private_ca_is_refused(tls_redis):
    port, _ = tls_redis
    store = FleetStore.from_url(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0")
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            store.client.ping()
    finally:
        store.close()
