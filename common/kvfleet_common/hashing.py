"""Chained block hashes: the one function engine and gateway both use to name KV-cache blocks.

For block ``i`` of a request (exactly ``block_size`` token ids)::

    h_i    = xxh3_128(h_{i-1} || int32-le(token ids of block i) || extra)
    h_{-1} = xxh3_128(b"kvfleet" || salt)

``salt`` is the tenant's cache salt (empty = shared cache) and ``extra`` carries anything else that
changes the KV content (e.g. a LoRA id). Chaining makes a block's hash name its whole prefix, so two
requests share block ``i`` only if they agree on every token before it. Only full blocks are hashed:
a partial block can still change, and the engine never shares it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

BlockHash = bytes  # 16 bytes; hex in JSON

HASH_DOMAIN = b"kvfleet"


def root_hash(salt: bytes | str = b"") -> BlockHash:
    """h_{-1}: the parent of a request's first block."""
    if isinstance(salt, str):
        salt = salt.encode()
    return xxhash.xxh3_128_digest(HASH_DOMAIN + salt)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block, chained to its parent's hash."""
    tokens = np.asarray(token_ids, dtype="<i4").tobytes()
    return xxhash.xxh3_128_digest(parent + tokens + extra)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes | str = b"",
    extra: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block is not hashed).

    ``parent`` continues an existing chain (the hash of the block before ``token_ids[0]``); by
    default the chain starts at :func:`root_hash` of ``salt``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = root_hash(salt) if parent is None else parent
    tokens = np.asarray(token_ids, dtype="<i4")
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxhash.xxh3_128_digest(h + tokens[start : start + block_size].tobytes() + extra)
        out.append(h)
    return out
