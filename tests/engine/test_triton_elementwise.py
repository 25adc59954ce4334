"""Fused Triton elementwise kernels (RMSNorm, rotary, SiLU-and-mul) vs torch references, and the engine
with them forced on vs off (runs under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvfleet_engine.layers.activation import SiluAndMul  # noqa: E402
from kvfleet_engine.layers.norm import RMSNorm  # noqa: E402
from kvfleet_engine.layers.rotary import RotaryEmbedding  # noqa: E402
from kvfleet_engine.ops import elementwise_triton as et  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# References: the torch expressions the layers ran before the kernels existed
# ----------------------------------------------------------------------------------------------------


def ref_rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, x)


def ref_rotary(q, k, positions, cos, sin):
    c, s = cos[positions].unsqueeze(1).to(q.dtype), sin[positions].unsqueeze(1).to(q.dtype)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def ref_silu_and_mul(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 896])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, hidden, with_residual):
    x = _randn(5, hidden, dtype=dtype, seed=1, scale=3.0)
    weight = (1 + 0.1 * _randn(hidden, seed=2)).to(dtype)
    residual = _randn(5, hidden, dtype=dtype, seed=3) if with_residual else None
    x_before = x.clone()
    res_before = residual.clone() if with_residual else None

    got = et.rms_norm(x, weight, 1e-5, residual)
    want = ref_rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert got[0].dtype == dtype and got[1].dtype == dtype
        torch.testing.assert_close(got[0], want[0], **TOL[dtype])
        # The residual sum is one add rounded to the input dtype: torch's bit for bit, except that the
        # CPU interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest.
        exact = dtype == torch.float32 or DEVICE == "cuda"
        torch.testing.assert_close(got[1], want[1], **({"atol": 0, "rtol": 0} if exact else TOL[dtype]))
        torch.testing.assert_close(residual, res_before, atol=0, rtol=0)
    else:
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


def test_rms_norm_strided_rows_3d_and_empty():
    base = _randn(2, 3, 56, seed=4)
    x = base[..., :40]  # rows with stride 56 != 40
    weight = _randn(40, seed=5)
    torch.testing.assert_close(
        et.rms_norm(x, weight, 1e-6), ref_rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5
    )
    empty = et.rms_norm(x[:0], weight, 1e-6, x[:0])
    assert empty[0].shape == (0, 3, 40) and empty[1].shape == (0, 3, 40)


def test_rms_norm_layer_dispatch():
    norm = RMSNorm(40, 1e-5)
    norm.weight.data = 1 + 0.1 * _randn(40, seed=6)
    x, residual = _randn(3, 40, seed=7), _randn(3, 40, seed=8)
    norm.use_triton = False
    want_out, want_res = norm(x, residual)
    want_plain = norm(x)
    norm.use_triton = True
    got_out, got_res = norm(x, residual)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_res, want_res, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(norm(x), want_plain, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Rotary
# ----------------------------------------------------------------------------------------------------


def _qkv_views(t, h, kvh, d, dtype, seed):
    """q, k (and v) as the non-contiguous views of one fused qkv projection output, as the model has them."""
    qkv = _randn(t, (h + 2 * kvh) * d, dtype=dtype, seed=seed)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    return qkv, q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 2, 16), (6, 1, 80), (3, 3, 8)])
def test_rotary_strided_qkv_views_match_reference(dtype, h, kvh, d):
    rope = RotaryEmbedding(d, 64, 10000.0, None).to(DEVICE)
    t = 7
    _, q, k, v = _qkv_views(t, h, kvh, d, dtype, seed=h * 100 + d)
    assert not q.is_contiguous() and q.stride(0) == (h + 2 * kvh) * d
    positions = torch.tensor([5, 0, 63, 17, 2, 2, 40], device=DEVICE)  # out of order, repeated, edges
    want_q, want_k = ref_rotary(q.clone(), k.clone(), positions, rope.cos, rope.sin)
    v_before = v.clone()

    got_q, got_k = et.rotary_(q, k, positions, rope.cos, rope.sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    torch.testing.assert_close(v, v_before, atol=0, rtol=0)  # the v heads next to k are untouched


def test_rotary_separate_tensors_and_many_heads():
    # Enough heads that q and k each span several programs (BLOCK_H < H).
    h, kvh, d, t = 80, 40, 64, 3
    rope = RotaryEmbedding(d, 16, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 8}).to(DEVICE)  # fmt: skip
    q, k = _randn(t, h, d, seed=9), _randn(t, kvh, d, seed=10)
    positions = torch.tensor([15, 3, 9], device=DEVICE)
    want_q, want_k = ref_rotary(q, k, positions, rope.cos, rope.sin)
    et.rotary_(q, k, positions, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)


def test_rotary_layer_reads_positions_every_call():
    """Under CUDA graphs the positions buffer keeps its identity while its contents change: the Triton
    path must use the new contents (the torch path's per-tensor cache would not)."""
    rope = RotaryEmbedding(16, 32, 10000.0, None).to(DEVICE)
    rope.use_triton = True
    positions = torch.tensor([1, 2, 3], device=DEVICE)
    _, q, k, _ = _qkv_views(3, 4, 2, 16, torch.float32, seed=11)
    rope(positions, q.clone(), k.clone())
    positions.copy_(torch.tensor([30, 0, 7]))
    want_q, want_k = ref_rotary(q, k, positions, rope.cos, rope.sin)
    got_q, got_k = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    assert rope._positions is None  # the gathered-table cache was never filled


# ----------------------------------------------------------------------------------------------------
# SiLU and mul
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [40, 1500])
def test_silu_and_mul_matches_reference(dtype, inter):
    x = _randn(4, 2 * inter, dtype=dtype, seed=12, scale=4.0)
    x_before = x.clone()
    got = et.silu_and_mul(x)
    assert got.shape == (4, inter) and got.dtype == dtype
    torch.testing.assert_close(got, ref_silu_and_mul(x), **TOL[dtype])
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


def test_silu_and_mul_layer_and_strided_input():
    act = SiluAndMul()
    base = _randn(2, 3, 100, seed=13)
    x = base[..., :80]  # rows with stride 100; gate = [:40], up = [40:80]
    act.use_triton = True
    got = act(x)
    act.use_triton = False
    want = act(x.clone())  # the torch path works in place on its input
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Dispatch policy and errors
# ----------------------------------------------------------------------------------------------------


def test_mode_from_env(monkeypatch):
    cases = {"": None, "auto": None, "1": True, "true": True, "0": False, "off": False}
    for value, mode in cases.items():
        monkeypatch.setenv(et.ENV_VAR, value)
        assert et.mode_from_env() is mode
        assert RMSNorm(8, 1e-6).use_triton is mode and SiluAndMul().use_triton is mode
    monkeypatch.setenv(et.ENV_VAR, "maybe")
    with pytest.raises(ValueError):
        et.mode_from_env()
    cpu = torch.zeros(1)
    assert et.wanted(True, cpu) and not et.wanted(False, cpu) and not et.wanted(None, cpu)


def test_shape_errors():
    with pytest.raises(ValueError):
        et.rms_norm(_randn(2, 8), _randn(9), 1e-6)
    with pytest.raises(ValueError):
        et.silu_and_mul(_randn(2, 7))
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    with pytest.raises(ValueError):
        et.rotary_(_randn(3, 2, 16), _randn(3, 1, 16), torch.zeros(2, dtype=torch.int64), rope.cos, rope.sin)


# ----------------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------------


def test_engine_tokens_equal_with_kernels_forced_on(demo_model, monkeypatch):
    from kvfleet_engine import LLM, SamplingParams

    path = demo_model(arch="llama", preset="tiny")
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 230, 41], [7, 7, 300, 12], [1000, 3])]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(mode: str) -> list[list[int]]:
        monkeypatch.setenv(et.ENV_VAR, mode)  # read by the layers when the model is built
        # Compiled kernels on a GPU (the engine then also captures decode graphs), interpreted ones on CPU.
        llm = LLM(path, dtype="float32", device=DEVICE, attention_backend="triton", use_tqdm=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    calls = {"rms_norm": 0, "rotary_": 0, "silu_and_mul": 0}
    for name in calls:
        fn = getattr(et, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(et, name, counted)

    off = run("0")
    assert calls == {"rms_norm": 0, "rotary_": 0, "silu_and_mul": 0}
    on = run("1")
    assert all(n > 0 for n in calls.values()), calls
    assert [len(t) for t in on] == [8, 8, 8]
    assert on == off
