"""Per-step attention metadata, set by the model runner around each forward pass.

Layers read it from here instead of having it threaded through every ``forward`` signature
(nano-vllm's "context"): the model code stays plain ``nn.Module``s.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    # Backend-specific precomputed state shared by every layer of this step (e.g. the torch path's
    # gathered index tensors), built once by the backend's ``plan``.
    plan: Any = None


_current: AttentionMetadata | None = None


def get_attn_metadata() -> AttentionMetadata | None:
    return _current


@contextmanager
def set_attn_metadata(meta: AttentionMetadata | None):
    global _current
    prev, _current = _current, meta
    try:
        yield
    finally:
        _current = prev
