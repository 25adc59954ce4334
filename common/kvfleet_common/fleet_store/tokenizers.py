"""Tokenizer distribution: an engine publishes its tokenizer files under a revision naming their
contents, the gateway fetches them and checks they still match it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, FleetStoreError, Op, as_text


def tokenizer_revision(files: Mapping[str, bytes]) -> str:
    """SHA-256 over the files, sorted by name, each name and body length-prefixed (unambiguous)."""
    if not files:
        raise ValueError("a tokenizer needs at least one file")
    h = hashlib.sha256()
    for name in sorted(files):
        body = files[name]
        if not isinstance(body, bytes | bytearray):
            raise TypeError(f"tokenizer file {name!r} must be bytes, got {type(body).__name__}")
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"invalid tokenizer file name {name!r}")
        raw = name.encode()
        h.update(len(raw).to_bytes(8, "little") + raw + len(body).to_bytes(8, "little"))
        h.update(body)
    return h.hexdigest()


def op_publish_tokenizer(model: str, files: Mapping[str, bytes]) -> Op:
    revision = tokenizer_revision(files)
    mapping: list[Any] = []
    for name, body in sorted(files.items()):
        mapping += [name, bytes(body)]
    yield Batch(
        [
            ("HSET", keys.model_tokenizer(model, revision), *mapping),
            ("SADD", keys.model_tokenizers(model), revision),
        ],
        transaction=True,
    )
    return revision


def op_fetch_tokenizer(model: str, revision: str) -> Op:
    (fields,) = yield Batch([("HGETALL", keys.model_tokenizer(model, revision))])
    if not fields:
        return None
    files = {as_text(k): bytes(v) for k, v in fields.items()}
    if tokenizer_revision(files) != revision:
        raise FleetStoreError(f"tokenizer {model}@{revision[:12]} in Redis does not match its revision")
    return files
