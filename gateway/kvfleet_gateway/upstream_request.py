"""What the gateway sends a replica for a client's request, and what it reserves for it at admission.

Pure functions of the validated request and the tenant's record (no I/O), shared by the proxy's paths.
"""

from __future__ import annotations

import json

from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_common.schemas import TenantRecord


def cache_salt(tenant: TenantRecord, client_salt: str | None) -> str:
    """The salt the engine hashes with: the tenant's own, extended (never replaced) by the client's."""
    return tenant.cache_salt + ("\x1f" + client_salt if client_salt else "")


def upstream_payload(body: CompletionRequest | ChatCompletionRequest, tenant: TenantRecord) -> bytes:
    """The JSON sent to the engine: the client's request with the tenant's priority and cache salt, and
    usage switched on for streams (see the module docstring)."""
    data = body.model_dump(mode="json", exclude_unset=True)
    data["priority"] = -tenant.priority + max(0, body.priority)
    salt = cache_salt(tenant, body.cache_salt)
    if salt:
        data["cache_salt"] = salt
    else:
        data.pop("cache_salt", None)
    if body.stream:
        opts = dict(data.get("stream_options") or {})
        opts["include_usage"] = True
        data["stream_options"] = opts
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def reservation_estimate(
    body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int | None, max_model_len: int
) -> int:
    """The most tokens a request can use, reserved against its tenant's tokens/min at admission: each
    prompt (exact when the gateway tokenized it, else ~4 characters a token) plus ``n`` times the
    completion limit (``max_tokens``; without one, the context left after the prompt, as the engine does)."""
    if isinstance(body, CompletionRequest):
        sizes = [len(p) if isinstance(p, list) else -(-len(p) // 4) for p in body.prompts()]
        limit = body.max_tokens
    else:
        sizes = [-(-sum(len(m.role) + len(m.text()) for m in body.messages) // 4)]
        limit = body.effective_max_tokens
    if prompt_tokens is not None:  # the first prompt, tokenized
        sizes[0] = prompt_tokens
    total = 0
    for size in sizes:
        room = max(0, max_model_len - size)
        total += size + body.n * (room if limit is None else min(limit, room))
    return total
