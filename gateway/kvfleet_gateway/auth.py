"""Who is calling: ``Authorization: Bearer <api key>`` -> the tenant (keys are stored as SHA-256 only)."""

from __future__ import annotations

import hashlib

from fastapi import Request

from kvfleet_common.schemas import TenantRecord
from kvfleet_common.server_kit.http import ApiError, bearer_token
from kvfleet_gateway.store_calls import RedisUnavailable, store_unavailable_error


async def require_tenant(request: Request) -> TenantRecord:
    """The calling tenant; 401 without a valid key, 503 while the tenants cannot be read (Redis down and
    nothing cached). A FastAPI dependency, and called directly by the fast path."""
    token = bearer_token(request)
    if token is None:
        request.app.state.metrics.rejected.labels("auth").inc()
        raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
    try:
        tenant = await request.app.state.tenants.lookup(hashlib.sha256(token.encode()).hexdigest())
    except RedisUnavailable as e:
        raise store_unavailable_error(e) from None
    if tenant is None:
        request.app.state.metrics.rejected.labels("auth").inc()
        raise ApiError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return tenant
