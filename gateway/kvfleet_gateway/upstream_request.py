"""What the gateway sends a replica for a client's request, and what it reserves for it at admission.

Pure functions of the validated request and the tenant's record (no I/O), shared by the proxy's paths.

The body sent upstream is the client's own bytes, every field (known to this gateway or not: ``tools``,
``response_format``, ``structured_outputs``, ``logit_bias``, ``prompt_logprobs``, ``echo``, ...) exactly as
sent, in its order: no pydantic re-dump drops, renames (``response_format.json_schema.schema`` is an alias)
or rewrites a field, and a large body is not serialized again. The gateway's own values are appended as the
object's last members (``gateway_fields``). Invariant this relies on: the engine's JSON parser keeps the last of
duplicate keys (Python's ``json``, FastAPI's, as the gateway's own parse did: the engine validates the same
request the gateway did, plus the gateway's values).
"""

from __future__ import annotations

import json

from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_common.schemas import TenantRecord


def cache_salt(tenant: TenantRecord, client_salt: str | None) -> str:
    """The salt the engine hashes with: the tenant's own, extended (never replaced) by the client's."""
    return tenant.cache_salt + ("\x1f" + client_salt if client_salt else "")


def gateway_fields(body: CompletionRequest | ChatCompletionRequest, tenant: TenantRecord) -> dict:
    """The fields the gateway decides, not the client: the tenant's priority (engine priority: lower runs
    first; a client may only lower its own), its cache salt (extended by the client's) and, for streams,
    ``stream_options.include_usage`` (the gateway meters every stream)."""
    fields: dict = {"priority": -tenant.priority + max(0, body.priority)}
    fields["cache_salt"] = cache_salt(tenant, body.cache_salt) or None
    if body.stream:
        opts = body.stream_options.model_dump(exclude_unset=True) if body.stream_options else {}
        fields["stream_options"] = {**opts, "include_usage": True}
    return fields


def upstream_payload(
    sent: bytes, body: CompletionRequest | ChatCompletionRequest, tenant: TenantRecord
) -> bytes:
    """The JSON sent to the engine: the client's body ``sent`` (``body`` is its validation) byte for byte,
    with ``gateway_fields`` appended as its last members (see the module docstring)."""
    tail = json.dumps(gateway_fields(body, tenant), separators=(",", ":"))[1:]  # '"priority":..}'
    head = sent.strip()
    # a UTF-8 object ends with "}" and starts with "{"; UTF-16/32 (which json.loads also reads) put a NUL
    # byte next to one of them: re-encoded as ASCII JSON then (values unchanged), never spliced
    if not (head.startswith(b"{") and head.endswith(b"}")):
        head = json.dumps(json.loads(sent), separators=(",", ":")).encode()
    return head[:-1] + b"," + tail.encode()


def reservation_estimate(
    body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int | None, max_model_len: int
) -> int:
    """The most tokens a request can use, reserved against its tenant's tokens/min at admission: each
    prompt (exact when the gateway tokenized it, else ~4 characters a token: a chat's texts and its tools,
    not a ``response_format`` schema, which is no part of the prompt) plus ``n`` times the completion limit
    (``max_tokens``; without one, the context left after the prompt, as the engine does)."""
    if isinstance(body, CompletionRequest):
        sizes = [len(p) if isinstance(p, list) else -(-len(p) // 4) for p in body.prompts()]
        limit = body.max_tokens
    else:
        limit = body.effective_max_tokens
        if prompt_tokens is None:  # not tokenized: what the template renders, estimated
            chars = sum(len(m.role) for m in body.messages) + sum(map(len, body.template_texts()))
            sizes = [-(-chars // 4)]
        else:
            sizes = [prompt_tokens]
    if prompt_tokens is not None:  # the first prompt, tokenized
        sizes[0] = prompt_tokens
    total = 0
    for size in sizes:
        room = max(0, max_model_len - size)
        total += size + body.n * (room if limit is None else min(limit, room))
    return total
