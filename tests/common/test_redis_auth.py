"""Redis with a password, the way every component meets it: devkit's RedisServer requires one (so every test
takes the authenticated path), a client without it is refused, Redis URLs are masked wherever they are
logged, and the gateway, the operator and an engine's presence thread say clearly (without the password)
that Redis refused their credentials: the first two exit non-zero at start-up, the engine keeps serving."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import redis.exceptions

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.redis_url import (
    RedisCredentialsError,
    check_credentials,
    is_credentials_error,
    mask_url,
)
from kvfleet_devkit.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@redis.ns.svc:6379/0", "redis://:***@redis.ns.svc:6379/0"),
        ("redis://:s3cr%40t@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://gateway:pw@h:6380/1?ssl_ca_certs=/etc/ca.crt&ssl_cert_reqs=required",
         "rediss://gateway:***@h:6380/1?ssl_ca_certs=/etc/ca.crt&ssl_cert_reqs=required"),
        ("redis://h:6379/0?password=s3cret&db=2", "redis://h:6379/0?password=***&db=2"),
        ("unix://:pw@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        ("redis://s3cret@h:6379", "redis://***@h:6379"),  # a lone user info: often a password by mistake
        ("redis://:pa/ss?w@rd@h:6379/0", "redis://:***@h:6379/0"),  # unescaped / ? @ in the password
    ],
)  # fmt: skip
def test_mask_url_hides_the_password_and_keeps_the_rest(url, masked):
    assert mask_url(url) == masked
    for secret in ("s3cret", "s3cr%40t", "pw@", ":pw", "pa/ss"):
        assert secret not in mask_url(url)


def test_redis_server_requires_its_password(redis_server):
    """devkit's RedisServer (every test's Redis) requires a password: without it Redis refuses (NOAUTH), with
    ``.url`` everything works, and the password is on no command line (a config file only its user reads)."""
    assert redis_server.password and f":{redis_server.password}@" in redis_server.url
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=redis_server.port, socket_timeout=2).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=redis_server.port, password="wrong", socket_timeout=2).ping()
    assert FleetStore.from_url(redis_server.url).client.ping()
    cmdline = Path(f"/proc/{redis_server.proc.pid}/cmdline").read_bytes().decode()
    assert redis_server.password not in cmdline
    assert (redis_server.workdir / "redis.conf").stat().st_mode & 0o077 == 0
    redis_server.restart()  # same password after a restart
    assert check_credentials(redis_server.url)


def test_check_credentials_tells_refused_credentials_from_an_unreachable_redis(redis_server):
    assert check_credentials(redis_server.url) is True
    without = f"redis://127.0.0.1:{redis_server.port}/0"
    wrong = f"redis://:not-{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(RedisCredentialsError) as missing:
        check_credentials(without)
    assert str(missing.value) == (
        f"Redis at {without} refused the credentials (NOAUTH: the URL has no password and Redis requires one): "
        "check the password in KVFLEET_REDIS_URL (or --redis-url)"
    )
    with pytest.raises(RedisCredentialsError) as refused:
        check_credentials(wrong)
    assert "WRONGPASS" in str(refused.value) and redis_server.password not in str(refused.value)
    assert f"redis://:***@127.0.0.1:{redis_server.port}/0" in str(refused.value)
    assert check_credentials(f"redis://:x@127.0.0.1:{free_port()}/0", timeout=1) is False  # nothing listens
    assert not is_credentials_error(redis.exceptions.ConnectionError("Connection refused"))
    assert is_credentials_error(redis.exceptions.ResponseError("WRONGPASS invalid username-password pair"))


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    return subprocess.run(
        [sys.executable, "-m", "kvfleet_cli.main", *args], capture_output=True, text=True, timeout=120,
        env={**clean, **env}, check=False, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.skipif(
    importlib.util.find_spec("kvfleet_gateway") is None, reason="the gateway is not installed"
)
def test_the_gateway_exits_at_once_on_a_wrong_password(redis_server):
    wrong = f"redis://:wrong-{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    started = time.monotonic()
    proc = _cli("gateway", "--port", str(free_port()), env={"KVFLEET_REDIS_URL": wrong})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert time.monotonic() - started < 60
    assert f"Redis at redis://:***@127.0.0.1:{redis_server.port}/0 refused the credentials (WRONGPASS" in out
    assert "check the password in KVFLEET_REDIS_URL" in out
    assert redis_server.password not in out and "wrong-" not in out
    # no password at all
    proc = _cli("gateway", "--port", str(free_port()), env={"KVFLEET_REDIS_URL": wrong.replace(":wrong-", ":")
                .replace(f":{redis_server.password}@", "")})  # fmt: skip
    assert proc.returncode == 2 and "(NOAUTH: the URL has no password" in proc.stderr, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("kopf") is None, reason="the operator is not installed")
def test_the_operator_exits_at_once_on_a_wrong_password(redis_server):
    wrong = f"redis://:wrong-{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    proc = _cli("operator", "--standalone", f"--server=http://127.0.0.1:{free_port()}",
                env={"KVFLEET_REDIS_URL": wrong})  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "kvfleet operator: Redis at redis://:***@127.0.0.1:" in out and "refused the credentials" in out
    assert redis_server.password not in out


def test_the_engine_presence_says_redis_refused_its_credentials_and_recovers(redis_server, caplog):
    """The engine keeps serving (the publisher never blocks it): the presence thread logs one ERROR naming
    the Redis (masked) and what to check, flags ``credentials_refused``, and keeps retrying, so a Redis whose
    password is fixed meanwhile sees the replica without an engine restart."""
    presence = pytest.importorskip("kvfleet_engine.presence")
    from kvfleet_common.schemas import ReplicaStats

    wrong_password = f"wrong-{redis_server.password}"
    url = f"redis://:{wrong_password}@127.0.0.1:{redis_server.port}/0"
    pub = presence.PresencePublisher(
        url, name="pod-0", model="org/tiny", base_url="http://pod-0:8000", block_size=4, max_model_len=64,
        stats=ReplicaStats, heartbeat_interval=0.1, ttl=2.0, max_backoff=0.1,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="kvfleet_engine.presence")
    pub.start()
    try:
        deadline = time.monotonic() + 10
        while not pub.credentials_refused and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pub.credentials_refused and not pub.connected
        pub.push_kv_events([("stored", b"\x00" * 16)])  # never blocks
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, errors
        assert (
            f"Redis at redis://:***@127.0.0.1:{redis_server.port}/0 refused the credentials (WRONGPASS"
            in errors[0]
        )
        assert "the engine keeps serving" in errors[0]
        assert all(wrong_password not in r.getMessage() for r in caplog.records)
        # The password is fixed on the Redis side: the replica appears without a restart.
        with redis_server.client() as admin:
            admin.config_set("requirepass", wrong_password)
        deadline = time.monotonic() + 10
        while not pub.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pub.connected and not pub.credentials_refused
    finally:
        pub.stop()
