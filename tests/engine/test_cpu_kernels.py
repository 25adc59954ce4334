"""The C CPU kernels against plain torch references, over the shapes that exercise their code paths.

The decode kernel walks the context in SIMD-width chunks of keys (a chunk may span pages, end
mid-page, or be a partial last chunk) and specializes head sizes 64 and 128; other multiples of the
SIMD width and odd head sizes take separate paths. Each case checks the output against float64
softmax attention over the gathered context.
"""

from __future__ import annotations

import pytest
import torch

from kvfleet_engine.ops import attention_cpu

pytestmark = pytest.mark.skipif(not attention_cpu.available(), reason="no C compiler for the CPU kernels")


def _reference_decode(q, k_cache, v_cache, tables, lens, scale):
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].double().transpose(0, 1).repeat_interleave(h // kvh, 0)
        v = v_cache[blocks].flatten(0, 1)[:n].double().transpose(0, 1).repeat_interleave(h // kvh, 0)
        s = torch.einsum("hd,hld->hl", q[i].double(), k) * scale
        out[i] = torch.einsum("hl,hld->hd", torch.softmax(s, -1), v)
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "lens"),
    [
        (8, 2, 64, 16, [1, 15, 16, 17, 100, 257]),  # the small demo model's shape
        (4, 4, 128, 32, [3, 31, 64, 130]),  # MHA, pages larger than a chunk
        (8, 1, 64, 8, [5, 9, 40]),  # pages shorter than a chunk: chunks span pages
        (2, 2, 64, 1, [1, 7, 33]),  # one token per page
        (4, 2, 96, 16, [2, 50]),  # a head size without a specialization
        (4, 2, 80, 16, [1, 19, 70]),  # not a multiple of the SIMD width: the generic loop
    ],
)
def test_paged_decode_matches_reference(heads, kv_heads, head_dim, block_size, lens):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    b = len(lens)
    max_len = max(lens)
    per_seq = -(-max_len // block_size)
    num_blocks = b * per_seq + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # Scattered pages, as the allocator hands them out after churn; table padded like the runner's.
    tables = torch.randperm(num_blocks, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(b, heads, head_dim, generator=gen) * 3  # peaked softmaxes too, not only flat ones
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    attention_cpu.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, max_len, out)
    ref = _reference_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)


def test_paged_decode_parallel_equals_serial():
    """Work is split over (sequence, KV head) items: the thread count must not change any bit (enough
    work here that two threads are really used)."""
    gen = torch.Generator().manual_seed(7)
    b, h, kvh, d, bs = 24, 8, 2, 64, 16
    lens = torch.randint(1, 1200, (b,), generator=gen, dtype=torch.int32)
    per_seq = -(-int(lens.max()) // bs)
    k_cache = torch.randn(b * per_seq, bs, kvh, d, generator=gen)
    v_cache = torch.randn(b * per_seq, bs, kvh, d, generator=gen)
    tables = torch.randperm(b * per_seq, generator=gen).view(b, per_seq).to(torch.int32)
    q = torch.randn(b, h, d, generator=gen)
    outs = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = torch.empty_like(q)
            attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, int(lens.max()), out)
        finally:
            torch.set_num_threads(prev)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = _reference_decode(q, k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-5, atol=2e-6)


# ---- elementwise kernels (RMSNorm + residual, rotary) through the layers that use them ------------------


@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 x 512 crosses the threshold for splitting rows
def test_rmsnorm_fused_matches_torch(tokens):
    from kvfleet_engine.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(512, 1e-5)
    norm.weight.data.copy_(torch.randn(512, generator=gen))
    x = torch.randn(tokens, 512, generator=gen) * 4
    res = torch.randn(tokens, 512, generator=gen)
    x0, res0 = x.clone(), res.clone()
    out, new_res = norm(x, res)
    h = x0.double() + res0.double()
    ref = norm.weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(new_res.double(), h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    alone = norm(x)
    ref_alone = (
        norm.weight.double() * x0.double() * torch.rsqrt(x0.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    )
    torch.testing.assert_close(alone.double(), ref_alone, rtol=2e-6, atol=2e-6)


def _rope_reference(rot, positions, x):
    cos, sin = rot.cos[positions].unsqueeze(1).double(), rot.sin[positions].unsqueeze(1).double()
    x = x.double()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 700])
def test_rotary_in_place_matches_torch(adjacent, tokens):
    from kvfleet_engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(tokens)
    h, kvh, d = 8, 2, 64
    rot = RotaryEmbedding(d, 4096, 500000.0, None)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (h + 2 * kvh) * d, generator=gen)
    before = qkv.clone()
    if adjacent:  # views of one fused projection output, as the model passes them
        q = qkv[:, : h * d].view(tokens, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(tokens, kvh, d)
    else:
        q = qkv[:, : h * d].clone().view(tokens, h, d)
        k = qkv[:, h * d : (h + kvh) * d].clone().view(tokens, kvh, d)
    q_ref = _rope_reference(rot, positions, before[:, : h * d].view(tokens, h, d))
    k_ref = _rope_reference(rot, positions, before[:, h * d : (h + kvh) * d].view(tokens, kvh, d))
    q_out, k_out = rot(positions, q, k)
    torch.testing.assert_close(q_out.double(), q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out.double(), k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (h + kvh) * d :], before[:, (h + kvh) * d :])  # v untouched


def test_rotary_out_of_range_positions_still_raise():
    """The C kernel indexes its tables unchecked; positions beyond them must take the torch path (which
    raises) rather than read out of bounds."""
    from kvfleet_engine.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(64, 32, 10000.0, None)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 1, 64)
    with pytest.raises(IndexError):
        rot(torch.tensor([3, 32]), q, k)
