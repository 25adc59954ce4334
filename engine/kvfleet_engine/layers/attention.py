"""Attention over the paged KV cache: write this step's K/V into their slots, then attend."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_engine.forward_context import get_attn_metadata
from kvfleet_engine.ops.attention_torch import attention_with_plan, write_kv_cache


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        # Bound by the model runner once the cache is allocated ([num_blocks, block_size, KVH, D]).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]."""
        meta = get_attn_metadata()
        if meta is None:
            raise RuntimeError("attention called outside a model-runner step (no attention metadata)")
        write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.backend == "torch":
            return attention_with_plan(q, k, v, self.k_cache, self.v_cache, meta.plan, self.scale)
        from kvfleet_engine.ops import attention_triton

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            attention_triton.decode_attention(
                q[:nd],
                self.k_cache,
                self.v_cache,
                meta.seq_lens[:nd],
                meta.block_tables[:nd],
                self.scale,
                out=out[:nd],
            )
        if nd < meta.seq_lens.shape[0]:
            qsl = meta.query_start_loc[nd:] - nd
            attention_triton.prefill_attention(
                q[nd:],
                self.k_cache,
                self.v_cache,
                qsl,
                meta.seq_lens[nd:],
                meta.block_tables[nd:],
                self.scale,
                out=out[nd:],
                max_query_len=meta.max_query_len,
            )
        return out
