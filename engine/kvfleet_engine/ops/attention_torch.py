"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested against.

Layout: ``k_cache``/``v_cache`` are [num_blocks, block_size, KVH, D]; sequence b's queries are
``q[query_start_loc[b]:query_start_loc[b+1]]``, the last ``q_len`` positions of its ``seq_lens[b]``
tokens, whose K/V are already in the cache. Causal, GQA (query head h reads KV head h // (H/KVH)).

The batch is ordered decodes first (one query each). On float32 CPU tensors decodes run in the C
kernel of ``attention_cpu`` straight from the pages; otherwise as one batched, masked SDPA over their
gathered pages. Prefills run per sequence with SDPA (straight on the new K/V when there is no cached
prefix, which is the common case and needs no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvfleet_engine.ops import attention_cpu


@dataclass(slots=True)
class PrefillSeq:
    q_start: int
    q_end: int
    seq_len: int
    block_ids: torch.Tensor | None  # None: no cached prefix, attend over the new K/V only


@dataclass(slots=True)
class TorchAttentionPlan:
    """Index tensors shared by every layer of one step."""

    num_decodes: int
    decode_blocks: torch.Tensor | None  # [Bd, M] page table of the decode rows (int32 for C, else int64)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, M*bs] bool, True = attend (torch decode path only)
    prefills: list[PrefillSeq]
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32 (C decode path only)
    max_decode_len: int = 0


def make_plan(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    num_decodes: int,
    block_size: int,
    device: torch.device | str,
    use_c_decode: bool = False,
) -> TorchAttentionPlan:
    decode_blocks = decode_mask = decode_lens = None
    max_decode_len = 0
    if num_decodes:
        lens = seq_lens[:num_decodes]
        max_decode_len = int(lens.max())
        m = -(-max_decode_len // block_size)
        if use_c_decode:
            decode_blocks = torch.from_numpy(
                np.ascontiguousarray(block_tables[:num_decodes, :m], dtype=np.int32)
            )
            decode_lens = torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int32))
        else:
            decode_blocks = torch.from_numpy(block_tables[:num_decodes, :m].astype(np.int64)).to(device)
            positions = np.arange(m * block_size)
            decode_mask = torch.from_numpy(positions[None, :] < lens[:, None]).to(device)[:, None, None, :]
    prefills = []
    for b in range(num_decodes, len(seq_lens)):
        q_start, q_end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        blocks = None
        if q_end - q_start < seq_len:
            nb = -(-seq_len // block_size)
            blocks = torch.from_numpy(block_tables[b, :nb].astype(np.int64)).to(device)
        prefills.append(PrefillSeq(q_start, q_end, seq_len, blocks))
    return TorchAttentionPlan(num_decodes, decode_blocks, decode_mask, prefills, decode_lens, max_decode_len)


def attention_with_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (this step's new tokens, already written to the cache)."""
    out = torch.empty_like(q)
    nd = plan.num_decodes
    if nd and plan.decode_seq_lens is not None:
        attention_cpu.paged_decode(
            q[:nd].contiguous(), k_cache, v_cache, plan.decode_blocks, plan.decode_seq_lens, scale,
            plan.max_decode_len, out[:nd],
        )  # fmt: skip
    elif nd:
        kd = k_cache[plan.decode_blocks].flatten(1, 2).transpose(1, 2)  # [Bd, KVH, L, D]
        vd = v_cache[plan.decode_blocks].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), kd, vd, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = o.squeeze(2)
    for p in plan.prefills:
        qs = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if p.block_ids is None:
            ks = k[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
            vs = v[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = k_cache[p.block_ids].flatten(0, 1)[: p.seq_len].transpose(0, 1).unsqueeze(0)
            vs = v_cache[p.block_ids].flatten(0, 1)[: p.seq_len].transpose(0, 1).unsqueeze(0)
            q_len = p.q_end - p.q_start
            offset = p.seq_len - q_len
            qpos = torch.arange(q_len, device=q.device)[:, None] + offset
            mask = torch.arange(p.seq_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[p.q_start : p.q_end] = o.squeeze(0).transpose(0, 1)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Stand-alone entry with the Triton kernels' signature (reads all K/V from the cache)."""
    qsl = query_start_loc.cpu().numpy()
    lens = seq_lens.cpu().numpy()
    tables = block_tables.cpu().numpy()
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(len(lens)):
        plan = TorchAttentionPlan(0, None, None, [])
        nb = -(-int(lens[b]) // block_size)
        blocks = torch.from_numpy(tables[b, :nb].astype(np.int64)).to(q.device)
        plan.prefills.append(PrefillSeq(0, int(qsl[b + 1] - qsl[b]), int(lens[b]), blocks))
        qb = q[int(qsl[b]) : int(qsl[b + 1])]
        out[int(qsl[b]) : int(qsl[b + 1])] = attention_with_plan(qb, qb, qb, k_cache, v_cache, plan, scale)
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)
