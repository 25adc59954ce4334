"""Triton paged attention kernels (prefill and decode) for the engine's GPU path.

Layout (fixed by the engine):

* ``q``: ``[T, H, D]`` (prefill, varlen) or ``[B, H, D]`` (decode, one query per sequence).
* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, KVH, D]``; query head ``h`` reads KV head
  ``h // (H // KVH)`` (GQA).
* ``block_tables``: ``[B, max_blocks_per_seq]`` int32; position ``j`` of sequence ``b`` lives at
  ``cache[block_tables[b, j // block_size], j % block_size]``.
* ``seq_lens``: ``[B]`` int32, the context length including the new tokens (already in the cache).
* ``query_start_loc``: ``[B + 1]`` int32 cumulative query counts; the ``q_len`` queries of a sequence
  sit at positions ``seq_len - q_len .. seq_len - 1``; attention is causal.

Design:

* Both kernels run an online softmax (flash-attention style, base-2 exponentials with the scale folded
  into ``log2(e)``) over tiles of ``BLOCK_N`` KV tokens gathered through the page table token by
  token, so the KV tile size is independent of the cache's block size. Accumulation is in float32.
* GQA: the query heads that share a KV head are packed into the rows of one program's query tile, so
  each K/V tile is loaded once per group instead of once per query head.
* Prefill: grid ``(query tiles, B, KVH)``; a tile holds ``BLOCK_M // GROUP`` query tokens x ``GROUP``
  heads. The KV loop runs in two phases: keys before the tile's first query position are visible to
  every row (no causal mask), the tail up to the tile's last position is masked.
* Decode: grid ``(B, KVH, NUM_SPLITS)``; rows are the ``GROUP`` heads (padded to 16 for ``tl.dot``).
  With ``NUM_SPLITS > 1`` (few sequences, long contexts) each sequence's context is divided evenly
  between splits (flash-decoding); partial outputs and log-sum-exps go to float32 scratch buffers
  and a small reduce kernel (grid ``(B, H)``) merges them.
* Head dims that are not a power of two (80, 96, ...) are padded to the next power of two with masks.

The module imports without triton (the engine only imports it on CUDA, tests import it on CPU where
the kernels run under ``TRITON_INTERPRET=1``); calling a kernel without triton raises a clear error.
"""

from __future__ import annotations

import functools

import torch

from kvfleet_engine.ops.triton_support import HAS_TRITON, check_triton, interpreting, jit_steady, tl, triton

__all__ = ["HAS_TRITON", "decode_attention", "decode_split_counts", "prefill_attention"]

_LOG2E = 1.4426950408889634


def _check_triton(t: torch.Tensor) -> None:
    check_triton(t, "kvfleet_engine.ops.attention_triton", "use the torch attention backend instead")


if HAS_TRITON:

    @triton.jit
    def _attn_tile(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        bt_row,
        kv_head_off_k,
        kv_head_off_v,
        pos,
        start,
        end,
        stride_bt_n,
        stride_kb,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vd,
        qk_scale,
        offs_d,
        d_mask,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL_MASK: tl.constexpr,
        BOUND_MASK: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One online-softmax step over the KV tokens ``start .. start + BLOCK_N`` (paged gather).

        ``BOUND_MASK``: mask tokens at or beyond ``end``; ``CAUSAL_MASK``: mask tokens after each row's
        query position ``pos``. ``qk_scale`` already includes ``log2(e)``.
        """
        offs_n = start + tl.arange(0, BLOCK_N)
        if BOUND_MASK:
            n_valid = offs_n < end
            blk = tl.load(bt_row + (offs_n // PAGE_SIZE) * stride_bt_n, mask=n_valid, other=0)
        else:
            blk = tl.load(bt_row + (offs_n // PAGE_SIZE) * stride_bt_n)
        blk = blk.to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        k_ptrs = (
            K + (blk * stride_kb + slot * stride_kt + kv_head_off_k)[:, None] + offs_d[None, :] * stride_kd
        )
        v_ptrs = (
            V + (blk * stride_vb + slot * stride_vt + kv_head_off_v)[:, None] + offs_d[None, :] * stride_vd
        )
        if BOUND_MASK:
            kv_mask = n_valid[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N] float32
        if CAUSAL_MASK:
            keep = offs_n[None, :] <= pos[:, None]
            if BOUND_MASK:
                keep = keep & n_valid[None, :]
            s = tl.where(keep, s, float("-inf"))
        elif BOUND_MASK:
            s = tl.where(n_valid[None, :], s, float("-inf"))

        # m_i starts at a finite floor, so fully masked rows never produce inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return acc, m_new, l_i

    # The block table's row stride is its width (the step's longest context), and the decode rows come
    # first, so the prefill rows' QSL/SL/BT pointers start at an offset that changes every step.
    @jit_steady(values=["stride_bt_b"], alignments=["QSL", "SL", "BT"])
    def _prefill_kernel(
        Q,
        K,
        V,
        Out,
        QSL,
        SL,
        BT,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_bt_b,
        stride_bt_n,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        TOK_PER_TILE: tl.constexpr = BLOCK_M // GROUP
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)

        q_start = tl.load(QSL + b)
        q_len = tl.load(QSL + b + 1) - q_start
        tile_tok0 = pid_m * TOK_PER_TILE
        if tile_tok0 >= q_len:
            return
        seq_len = tl.load(SL + b)
        ctx = seq_len - q_len  # position of the sequence's first query

        rows = tl.arange(0, BLOCK_M)
        tok = tile_tok0 + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_valid = (rows < TOK_PER_TILE * GROUP) & (tok < q_len)
        pos = ctx + tok

        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tok64 = (q_start + tok).to(tl.int64)
        q_ptrs = Q + (tok64 * stride_qt + head * stride_qh)[:, None] + offs_d[None, :] * stride_qd
        io_mask = row_valid[:, None] & d_mask[None, :]
        q = tl.load(q_ptrs, mask=io_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)  # K/V tiles follow q's dtype in _attn_tile

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

        bt_row = BT + b.to(tl.int64) * stride_bt_b
        koff = kvh.to(tl.int64) * stride_kh
        voff = kvh.to(tl.int64) * stride_vh

        # Phase 1: keys before the tile's first query position are visible to every row.
        first_pos = ctx + tile_tok0
        full_end = (first_pos // BLOCK_N) * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, K, V, bt_row, koff, voff, pos, start, full_end,
                stride_bt_n, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                qk_scale, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, False, False, DOT_PRECISION,
            )  # fmt: skip
        # Phase 2: the diagonal, causal mask and the sequence end.
        kv_end = tl.minimum(seq_len, first_pos + TOK_PER_TILE)
        for start in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, K, V, bt_row, koff, voff, pos, start, kv_end,
                stride_bt_n, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                qk_scale, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, True, True, DOT_PRECISION,
            )  # fmt: skip

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = Out + (tok64 * stride_ot + head * stride_oh)[:, None] + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)

    @jit_steady(values=["stride_bt_b"], alignments=["SL", "BT"])
    def _decode_kernel(
        Q,
        K,
        V,
        Out,
        OP,
        LSE,
        SL,
        BT,
        qk_scale,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_od,
        stride_bt_b,
        stride_bt_n,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SL + b)

        rows = tl.arange(0, BLOCK_G)
        row_valid = rows < GROUP
        head = kvh * GROUP + rows
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        io_mask = row_valid[:, None] & d_mask[None, :]
        b64 = b.to(tl.int64)
        q_ptrs = Q + (b64 * stride_qb + head * stride_qh)[:, None] + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=io_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)  # K/V tiles follow q's dtype in _attn_tile

        if NUM_SPLITS == 1:
            start = 0
            end = seq_len
        else:
            # Divide this sequence's context evenly between the splits (in whole KV tiles).
            per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
            start = split * per_split
            end = tl.minimum(seq_len, start + per_split)

        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        pos = tl.zeros([BLOCK_G], dtype=tl.int32)  # unused: decode needs no causal mask

        bt_row = BT + b64 * stride_bt_b
        koff = kvh.to(tl.int64) * stride_kh
        voff = kvh.to(tl.int64) * stride_vh
        for s in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, K, V, bt_row, koff, voff, pos, s, end,
                stride_bt_n, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                qk_scale, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, False, True, DOT_PRECISION,
            )  # fmt: skip

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        if NUM_SPLITS == 1:
            o_ptrs = Out + (b64 * stride_ob + head * stride_oh)[:, None] + offs_d[None, :] * stride_od
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)
        else:
            # Scratch buffers are contiguous: OP [B, H, NUM_SPLITS, BLOCK_D], LSE [B, H, NUM_SPLITS].
            num_heads = tl.num_programs(1) * GROUP
            idx = (b64 * num_heads + head) * NUM_SPLITS + split  # [BLOCK_G]
            # Whole padded rows (padding columns hold zeros) so the reduce never reads uninitialized memory.
            tl.store(OP + idx[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_valid[:, None])
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(LSE + idx, lse, mask=row_valid)

    @triton.jit
    def _decode_reduce_kernel(
        OP,
        LSE,
        Out,
        stride_ob,
        stride_oh,
        stride_od,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        num_heads = tl.num_programs(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        base = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS
        lse = tl.load(LSE + base + offs_s)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # empty context (seq_len 0): output zeros
        w = tl.exp2(lse - m)
        denom = tl.sum(w, 0)
        part = tl.load(OP + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :])
        out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
        o_ptrs = Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_mask)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_options(dtype: torch.dtype) -> dict:
    # The interpreter's tl.dot multiplies bfloat16 tiles as their raw uint16 storage (triton 3.x), so
    # under TRITON_INTERPRET the dots run in float32 instead. On GPU 16-bit tiles feed the tensor cores
    # natively; float32 inputs use "ieee" so they never silently drop to tf32.
    dot_fp32 = dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
    return {"DOT_PRECISION": "ieee" if dot_fp32 else "tf32", "DOT_FP32": dot_fp32}


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected q [T, H, D] and k/v caches [num_blocks, block_size, KVH, D]; got "
            f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kd = k_cache.shape
    if kd != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"head mismatch: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if page_size & (page_size - 1):
        raise ValueError(f"block_size must be a power of two, got {page_size}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks_per_seq], got {tuple(block_tables.shape)}")
    return num_heads, head_dim, page_size, num_kv_heads


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention for any ``q_len >= 1`` per sequence; returns ``[T, H, D]``.

    ``max_query_len`` (host int) avoids a device sync; computed from ``query_start_loc`` when None.
    """
    _check_triton(q)
    num_heads, head_dim, page_size, num_kv_heads = _check_shapes(q, k_cache, v_cache, block_tables)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    if interpreting():
        block_m, block_n, num_warps = 16, 16, 4
    else:
        block_m, block_n, num_warps = 64, 64, 4
        if head_dim <= 64:
            block_m = 128
    block_m = max(block_m, triton.next_power_of_2(group))
    tok_per_tile = block_m // group
    grid = (triton.cdiv(max_query_len, tok_per_tile), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        GROUP=group,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **_dot_options(q.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    return out


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_num_splits(
    q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_context: int, block_n: int
) -> int:
    if q.device.type != "cuda":
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return split_count(sms, num_seqs, num_kv_heads, max_context, block_n)


def split_count(sms: int, num_seqs: int, num_kv_heads: int, max_context: int, block_n: int) -> int:
    """Flash-decoding split count: split the context only when (batch x kv heads) underfills the GPU."""
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    by_occupancy = -(-2 * sms // programs)
    return _floor_pow2(min(_splits_by_context(max_context, block_n), by_occupancy))


_MAX_SPLITS = 32


def _splits_by_context(max_context: int, block_n: int) -> int:
    # Each split should keep at least a few KV tiles of work (~256 tokens).
    return min(_MAX_SPLITS, max(1, max_context // max(256, 4 * block_n)))


def _floor_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)  # powers of two: few kernel variants


def decode_split_counts(max_context: int) -> list[int]:
    """Every split count ``decode_attention`` can choose on the GPU for contexts up to ``max_context``."""
    most = _floor_pow2(_splits_by_context(max_context, _decode_tiles()[0]))
    return [1 << i for i in range(most.bit_length())]


def _decode_tiles() -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel."""
    return (16, 4) if interpreting() else (64, 4)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Paged attention for one query per sequence (at position ``seq_lens[b] - 1``); returns ``[B, H, D]``.

    ``num_splits`` (a power of two) forces the number of context splits; by default it is chosen
    from the batch size, the KV head count and ``block_tables.shape[1]`` (no device sync).
    """
    _check_triton(q)
    num_heads, head_dim, page_size, num_kv_heads = _check_shapes(q, k_cache, v_cache, block_tables)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = q.shape[0]
    if num_seqs == 0:
        return out
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"decode expects one query per sequence: q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )

    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    block_d = _block_d(head_dim)
    block_n, num_warps = _decode_tiles()
    if num_splits is None:
        num_splits = _pick_num_splits(q, num_seqs, num_kv_heads, block_tables.shape[1] * page_size, block_n)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")

    if num_splits > 1:
        o_part = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse = out  # unused by the kernel

    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, o_part, lse, seq_lens, block_tables,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_G=block_g,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        **_dot_options(q.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            o_part, lse, out,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
