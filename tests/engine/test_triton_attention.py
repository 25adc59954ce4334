"""Triton paged attention kernels vs a naive torch reference.

On the test device (KVFLEET_TEST_DEVICE): compiled kernels on CUDA, under ``TRITON_INTERPRET=1`` on the
CPU (the ``triton_device`` fixture, tests/engine/conftest.py, skips a CPU run where Triton would compile).
"""

from __future__ import annotations

import importlib
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvfleet_engine.ops import attention_triton as at  # noqa: E402

pytestmark = pytest.mark.triton


# ----------------------------------------------------------------------------------------------------
# Reference and batch construction
# ----------------------------------------------------------------------------------------------------


def reference_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale):
    """Obviously-correct paged causal attention: per sequence, gather K/V, mask, softmax in float64."""
    num_heads = q.shape[1]
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = block_tables[b].long()[pos // page_size]
        k = k_cache[blocks, pos % page_size].double()  # [S, KVH, D]
        v = v_cache[blocks, pos % page_size].double()
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q1].double()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qs, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        visible = pos[None, :] <= q_pos[:, None]  # [L, S]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hls,shd->lhd", probs, v)
    return out


def make_batch(
    q_lens,
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    page_size=16,
    seed=0,
    extra_blocks=3,
    *,
    device,
):
    """Random q / paged KV cache with shuffled, non-contiguous block ids and padded block tables, on ``device``
    (built on the CPU first, so the values do not depend on the device)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_seq) + 1  # always at least one padding column
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    k_cache = torch.randn((num_blocks, page_size, num_kv_heads, head_dim), generator=g).to(dtype)
    v_cache = torch.randn((num_blocks, page_size, num_kv_heads, head_dim), generator=g).to(dtype)
    total = sum(q_lens)
    q = torch.randn((total, num_heads, head_dim), generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), to(qsl), to(sl), to(block_tables)


def _tol(dtype):
    return {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def _assert_close(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    tol = _tol(dtype)
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------------
# Prefill (varlen)
# ----------------------------------------------------------------------------------------------------

# (q_lens, seq_lens): decode-like single tokens, chunks with a cached prefix, full prompts, and
# lengths that are not multiples of the page size.
PREFILL_CASES = {
    "mixed": ([1, 7, 21, 3], [13, 29, 21, 3]),
    "chunk_after_prefix": ([18], [43]),
    "full_prompt_long": ([37], [37]),
}


@pytest.mark.parametrize(
    ("case", "num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        ("mixed", 2, 2, 16, torch.float32),  # MHA
        ("mixed", 4, 2, 32, torch.float32),  # GQA 2
        ("mixed", 4, 1, 16, torch.float32),  # GQA 4
        ("chunk_after_prefix", 4, 1, 16, torch.float32),
        ("full_prompt_long", 2, 1, 16, torch.float32),
        ("mixed", 2, 1, 24, torch.float32),  # non-power-of-two head dim (padded to 32)
        ("mixed", 4, 2, 16, torch.bfloat16),
        ("chunk_after_prefix", 2, 2, 16, torch.float16),
    ],
)
def test_prefill_matches_reference(case, num_heads, num_kv_heads, head_dim, dtype, triton_device):
    q_lens, seq_lens = PREFILL_CASES[case]
    q, kc, vc, qsl, sl, bt = make_batch(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, device=triton_device
    )
    scale = 1.0 / math.sqrt(head_dim)
    out = at.prefill_attention(q, kc, vc, qsl, sl, bt, scale)
    ref = reference_attention(q.cpu(), kc.cpu(), vc.cpu(), qsl.cpu(), sl.cpu(), bt.cpu(), scale)
    assert out.shape == q.shape
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("page_size", [4, 32])
def test_prefill_page_sizes(page_size, triton_device):
    """KV tiles spanning several small pages, and pages larger than a KV tile."""
    q_lens, seq_lens = [1, 10, 26], [45, 10, 38]
    q, kc, vc, qsl, sl, bt = make_batch(
        q_lens, seq_lens, 4, 2, 16, torch.float32, page_size=page_size, seed=2, device=triton_device
    )
    out = at.prefill_attention(q, kc, vc, qsl, sl, bt, 0.25)
    ref = reference_attention(q.cpu(), kc.cpu(), vc.cpu(), qsl.cpu(), sl.cpu(), bt.cpu(), 0.25)
    _assert_close(out, ref, torch.float32)


def test_prefill_writes_into_out_and_accepts_max_query_len(triton_device):
    q_lens, seq_lens = [5, 1, 9], [5, 17, 30]
    q, kc, vc, qsl, sl, bt = make_batch(
        q_lens, seq_lens, 4, 2, 16, torch.float32, page_size=8, seed=3, device=triton_device
    )
    out = torch.full_like(q, float("nan"))
    res = at.prefill_attention(q, kc, vc, qsl, sl, bt, 0.3, out=out, max_query_len=max(q_lens))
    assert res.data_ptr() == out.data_ptr()
    ref = reference_attention(q.cpu(), kc.cpu(), vc.cpu(), qsl.cpu(), sl.cpu(), bt.cpu(), 0.3)
    _assert_close(out, ref, torch.float32)


def test_prefill_empty_sequence_in_batch(triton_device):
    """A sequence with no queries (q_len 0) contributes nothing and does not disturb its neighbours."""
    q, kc, vc, qsl, sl, bt = make_batch(
        [3, 4], [3, 20], 2, 1, 16, torch.float32, seed=5, device=triton_device
    )
    qsl = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=q.device)
    sl = torch.tensor([3, 9, 20], dtype=torch.int32, device=q.device)
    bt = torch.cat([bt[:1], bt[:1], bt[1:]], dim=0)
    out = at.prefill_attention(q, kc, vc, qsl, sl, bt, 0.25)
    ref = reference_attention(q.cpu(), kc.cpu(), vc.cpu(), qsl.cpu(), sl.cpu(), bt.cpu(), 0.25)
    _assert_close(out, ref, torch.float32)


# ----------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "num_splits"),
    [
        (2, 2, 16, torch.float32, 1),
        (4, 2, 32, torch.float32, 1),
        (8, 2, 16, torch.float32, 1),  # GQA 4
        (4, 1, 16, torch.float32, 4),  # flash-decoding splits, some of them empty for short sequences
        (4, 2, 24, torch.float32, 2),  # non-power-of-two head dim with splits
        (4, 2, 16, torch.bfloat16, 1),
        (4, 1, 16, torch.bfloat16, 2),
    ],
)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, dtype, num_splits, triton_device):
    seq_lens = [1, 17, 40, 9]
    q, kc, vc, qsl, sl, bt = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=1, device=triton_device
    )
    scale = 1.0 / math.sqrt(head_dim)
    out = at.decode_attention(q, kc, vc, sl, bt, scale, num_splits=num_splits)
    ref = reference_attention(q.cpu(), kc.cpu(), vc.cpu(), qsl.cpu(), sl.cpu(), bt.cpu(), scale)
    assert out.shape == q.shape
    _assert_close(out, ref, dtype)


def test_decode_writes_into_out_and_agrees_with_prefill(triton_device):
    seq_lens = [33, 5, 16]
    q, kc, vc, qsl, sl, bt = make_batch(
        [1] * 3, seq_lens, 4, 2, 32, torch.float32, page_size=8, seed=7, device=triton_device
    )
    out = torch.full_like(q, float("nan"))
    res = at.decode_attention(q, kc, vc, sl, bt, 0.2, out=out)
    assert res.data_ptr() == out.data_ptr()
    via_prefill = at.prefill_attention(q, kc, vc, qsl, sl, bt, 0.2, max_query_len=1)
    torch.testing.assert_close(out, via_prefill, atol=1e-5, rtol=1e-5)


def test_decode_zero_length_sequence_gives_zeros(triton_device):
    """Padded batch slots (seq_len 0, as in captured CUDA graphs) must not produce NaNs."""
    q, kc, vc, _, _, bt = make_batch([1, 1], [12, 12], 2, 1, 16, torch.float32, seed=9, device=triton_device)
    sl = torch.tensor([12, 0], dtype=torch.int32, device=q.device)
    for splits in (1, 2):
        out = at.decode_attention(q, kc, vc, sl, bt, 0.25, num_splits=splits)
        assert torch.isfinite(out).all()
        assert torch.count_nonzero(out[1]) == 0


# ----------------------------------------------------------------------------------------------------
# Cross-check with the engine's torch backend (when present)
# ----------------------------------------------------------------------------------------------------


def _torch_backend():
    try:
        mod = importlib.import_module("kvfleet_engine.ops.attention_torch")
    except ImportError:
        pytest.skip("kvfleet_engine.ops.attention_torch is not available")
    fn = getattr(mod, "paged_attention", None)
    if fn is None:
        pytest.skip("attention_torch has no paged_attention")
    return fn


def test_kernels_match_torch_backend(triton_device):
    paged_attention = _torch_backend()
    q_lens, seq_lens = [1, 6, 19], [24, 11, 19]
    q, kc, vc, qsl, sl, bt = make_batch(
        q_lens, seq_lens, 4, 2, 16, torch.float32, seed=11, device=triton_device
    )
    scale = 0.25
    expected = paged_attention(q, kc, vc, qsl, sl, bt, scale)
    out = at.prefill_attention(q, kc, vc, qsl, sl, bt, scale)
    torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-4, rtol=1e-4)

    dq, dkc, dvc, dqsl, dsl, dbt = make_batch(
        [1, 1], [24, 7], 4, 2, 16, torch.float32, seed=12, device=triton_device
    )
    expected = paged_attention(dq, dkc, dvc, dqsl, dsl, dbt, scale)
    out = at.decode_attention(dq, dkc, dvc, dsl, dbt, scale)
    torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------


def test_shape_errors(triton_device):
    q, kc, vc, qsl, sl, bt = make_batch([2], [2], 3, 2, 16, torch.float32, device=triton_device)
    with pytest.raises(ValueError):
        at.prefill_attention(q, kc, vc, qsl, sl, bt, 0.25)  # 3 heads do not divide into 2 kv heads
    q, kc, vc, qsl, sl, bt = make_batch([1], [4], 2, 1, 16, torch.float32, device=triton_device)
    with pytest.raises(ValueError):
        at.decode_attention(q, kc, vc, sl, bt, 0.25, num_splits=3)
