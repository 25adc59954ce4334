"""Redis URLs as components log them, and the start-up check that their credentials are accepted.

A Redis URL carries the password (``redis://:PASSWORD@host:6379/0``, ``rediss://user:PASSWORD@...``, or a
``password=`` query parameter), so it is never logged or printed as given: every log line that names a Redis
URL goes through ``mask_url``.

Start-up: the gateway and the operator call ``check_credentials`` before they serve and exit non-zero with
``RedisCredentialsError``'s message when Redis refuses the password (a Redis that is merely down is not an
error there: they start and keep retrying). The engine's presence thread uses ``is_credentials_error`` and
``credentials_message`` to say the same in its log while the engine keeps serving.

TLS: ``rediss://`` URLs work in every component (they all build clients with redis-py's ``from_url``);
redis-py passes the query parameters ``ssl_cert_reqs`` (``required``/``optional``/``none``),
``ssl_ca_certs`` (a CA bundle file), ``ssl_certfile``/``ssl_keyfile`` (client certificate) and
``ssl_check_hostname`` on to the TLS connection, e.g.
``rediss://:PASSWORD@redis.example:6380/0?ssl_ca_certs=/etc/kvfleet/redis-ca/ca.crt``.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
import redis.exceptions

MASK = "***"
# query parameters whose value is a secret (redis-py reads ``password`` from the query too)
_SECRET_QUERY_KEYS = frozenset({"password"})
_REFUSALS = ("WRONGPASS", "NOAUTH", "invalid password", "called without any password", "invalid username")


class RedisCredentialsError(Exception):
    """Redis refused this component's credentials; the message names the Redis (masked) and what to fix."""


def mask_url(url: str) -> str:
    """``url`` with its password (user info, or a ``password=`` query parameter) replaced by ``***``; the
    user name, host, port, database and other parameters stay, so the line still says which Redis.

    Conservative where a URL is ambiguous: everything up to the *last* ``@`` counts as user info (a password
    may hold an unescaped ``/``, ``?`` or ``@``), and a lone user info (``redis://SECRET@host``) is masked
    whole, as people put passwords there by mistake."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, after = rest.rpartition("@")
    if at:
        user, has_password, _ = userinfo.partition(":")
        rest = f"{user}:{MASK}@{after}" if has_password else f"{MASK}@{after}"
    path, qmark, query = rest.partition("?")
    if qmark:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, MASK if k in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/")
    return f"{scheme}://{path}{qmark}{query}"


def is_credentials_error(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing the credentials (wrong or missing password, unknown user),
    as opposed to Redis being unreachable."""
    if isinstance(
        error, redis.exceptions.AuthenticationError | redis.exceptions.AuthenticationWrongNumberOfArgsError
    ):
        return True
    return isinstance(error, redis.exceptions.ResponseError) and any(r in str(error) for r in _REFUSALS)


def credentials_message(url: str, error: BaseException, env: str = "KVFLEET_REDIS_URL") -> str:
    """One line saying that Redis refused the credentials, why, and what to check; never the password."""
    text = str(error)
    if not _has_password(url):
        reason = "NOAUTH: the URL has no password and Redis requires one"
    elif "WRONGPASS" in text or "invalid username-password" in text or "invalid password" in text:
        reason = "WRONGPASS: wrong password (or user name)"
    else:
        reason = text
    return f"Redis at {mask_url(url)} refused the credentials ({reason}): check the password in {env} (or --redis-url)"


def _has_password(url: str) -> bool:
    parts = urlsplit(url)
    try:
        password = parts.password
    except ValueError:
        return True
    return bool(password) or any(k in _SECRET_QUERY_KEYS for k, _ in parse_qsl(parts.query))


def check_credentials(url: str, timeout: float = 5.0) -> bool:
    """PING Redis with the credentials of ``url``: True when it answered, False when it is unreachable
    (the caller starts anyway and retries); ``RedisCredentialsError`` when it refused the credentials."""
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
        return True
    except redis.exceptions.RedisError as e:
        if is_credentials_error(e):
            raise RedisCredentialsError(credentials_message(url, e)) from None
        if isinstance(e, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
            return False
        raise
    finally:
        client.close()
