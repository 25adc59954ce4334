"""Sampler tests: every SamplingParams feature against simple references (CPU, fixed seeds)."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet_engine.input_processor import request_stop_token_ids
from kvfleet_engine.layers.sampler import Sampler, SamplingMetadata, make_generator
from kvfleet_engine.sampling_params import SamplingParams

DEVICE = torch.device("cpu")


def build_metadata(
    params: list[SamplingParams],
    vocab: int,
    *,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    default_generator: torch.Generator | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplingMetadata:
    """What the model runner builds from its persistent batch."""
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    temps = [p.temperature for p in params]
    no_penalties = not any(p.has_penalties for p in params)
    prompt_ids = None
    if not no_penalties:
        width = max(len(p) for p in prompts)
        prompt_ids = torch.tensor([p + [vocab] * (width - len(p)) for p in prompts], dtype=torch.int64).view(
            n, width
        )
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    min_tokens = {
        i: (p.min_tokens, request_stop_token_ids(p, eos_token_ids))
        for i, p in enumerate(params)
        if p.min_tokens > 0
    }
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(t == 0.0 for t in temps),
        all_random=all(t != 0.0 for t in temps),
        top_p=torch.tensor([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64)
        if any(p.top_k for p in params)
        else None,
        min_p=torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        generators=generators or {},
        max_num_logprobs=max(logprobs) if logprobs else None,
        no_penalties=no_penalties,
        prompt_token_ids=prompt_ids,
        output_token_ids=outputs,
        frequency_penalties=None if no_penalties else torch.tensor([p.frequency_penalty for p in params]),
        presence_penalties=None if no_penalties else torch.tensor([p.presence_penalty for p in params]),
        repetition_penalties=None if no_penalties else torch.tensor([p.repetition_penalty for p in params]),
        min_tokens=min_tokens,
        default_generator=default_generator,
    )


def rand_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


# --------------------------------------------------------------------------------- greedy, logprobs


def test_greedy_is_argmax_and_fast_path(sampler):
    logits = rand_logits(6, 50)
    before = logits.clone()
    md = build_metadata([SamplingParams(temperature=0.0)] * 6, 50)
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)  # the caller's logits are never edited


def test_greedy_bfloat16_logits(sampler):
    logits = rand_logits(4, 40).to(torch.bfloat16)
    md = build_metadata([SamplingParams(temperature=0.0, logprobs=2)] * 4, 40)
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs.logprobs.dtype == torch.float32
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0], ref.gather(1, out.sampled_token_ids[:, None])[:, 0]
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_and_ranks(sampler, temperature):
    vocab, n = 64, 5
    logits = rand_logits(8, vocab, seed=3)
    params = [SamplingParams(temperature=temperature, logprobs=n, repetition_penalty=1.3)] * 8
    md = build_metadata(
        params,
        vocab,
        outputs=[[1, 2, 3]] * 8,
        prompts=[[4, 5]] * 8,
        default_generator=make_generator(0, DEVICE),
    )
    out = sampler(logits, md)
    lp = out.logprobs
    ref = torch.log_softmax(logits, dim=-1)  # raw logits: before penalties and temperature
    sampled = out.sampled_token_ids
    assert lp.token_ids.shape == (8, 1 + n) and lp.logprobs.shape == (8, 1 + n)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs, ref.gather(1, lp.token_ids), atol=1e-6, rtol=0)
    top_lp, top_ids = ref.topk(n, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_lp, atol=1e-6, rtol=0)
    for row in range(8):
        order = ref[row].argsort(descending=True).tolist()
        assert lp.ranks[row].item() == order.index(sampled[row].item()) + 1


def test_zero_logprobs_returns_sampled_only(sampler):
    logits = rand_logits(3, 20)
    md = build_metadata([SamplingParams(temperature=0.0, logprobs=0)] * 3, 20)
    out = sampler(logits, md)
    assert out.logprobs.token_ids.shape == (3, 1)
    assert torch.equal(out.logprobs.ranks, torch.ones(3, dtype=torch.int64))


# ---------------------------------------------------------------------------- random distribution


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    total = counts.sum()
    expected = probs * total
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(sampler, temperature):
    vocab, rows = 8, 40_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    logits = base.expand(rows, vocab).contiguous()
    md = build_metadata(
        [SamplingParams(temperature=temperature)] * rows, vocab, default_generator=make_generator(1, DEVICE)
    )
    out = sampler(logits, md)
    probs = torch.softmax(base / temperature, -1)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).float()
    # 7 degrees of freedom: P(chi2 > 30) < 1e-4.
    assert _chi_square(counts, probs) < 30.0
    assert (_frequencies(out.sampled_token_ids, vocab) - probs).abs().max() < 0.015


def test_top_k_never_samples_excluded(sampler):
    vocab, rows = 30, 2000
    logits = rand_logits(rows, vocab, seed=5)
    ks = [1, 3, 0, 7] * (rows // 4)  # 0: disabled
    params = [SamplingParams(temperature=1.5, top_k=k) for k in ks]
    out = sampler(logits, build_metadata(params, vocab, default_generator=make_generator(2, DEVICE)))
    for row, k in enumerate(ks):
        if k:
            allowed = set(logits[row].topk(k).indices.tolist())
            assert out.sampled_token_ids[row].item() in allowed
    top1 = torch.tensor([r for r, k in enumerate(ks) if k == 1])
    assert torch.equal(out.sampled_token_ids[top1], logits[top1].argmax(-1))


def test_top_p_never_samples_excluded(sampler):
    vocab, rows = 30, 2000
    logits = rand_logits(rows, vocab, seed=6, scale=2.0)
    ps = [0.1, 0.5, 0.9, 1.0] * (rows // 4)
    params = [SamplingParams(temperature=1.0, top_p=p) for p in ps]
    out = sampler(logits, build_metadata(params, vocab, default_generator=make_generator(3, DEVICE)))
    probs = torch.softmax(logits, -1)
    for row, p in enumerate(ps):
        sorted_p, order = probs[row].sort(descending=True)
        # Smallest prefix whose mass reaches p (always at least one token).
        n_keep = int((sorted_p.cumsum(0) < p).sum().item()) + 1
        allowed = set(order[:n_keep].tolist())
        assert out.sampled_token_ids[row].item() in allowed, (row, p)


def test_top_p_small_keeps_best_token(sampler):
    logits = rand_logits(50, 100, seed=11)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 50
    out = sampler(logits, build_metadata(params, 100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_and_top_p_together(sampler):
    vocab, rows = 40, 1000
    logits = rand_logits(rows, vocab, seed=12)
    params = [SamplingParams(temperature=1.0, top_k=5, top_p=0.6)] * rows
    out = sampler(logits, build_metadata(params, vocab, default_generator=make_generator(4, DEVICE)))
    for row in range(rows):
        top5 = logits[row].topk(5)
        renorm = torch.softmax(top5.values, -1)
        n_keep = int((renorm.cumsum(0) < 0.6).sum().item()) + 1
        assert out.sampled_token_ids[row].item() in set(top5.indices[:n_keep].tolist())


def test_min_p_never_samples_excluded(sampler):
    vocab, rows = 30, 2000
    logits = rand_logits(rows, vocab, seed=7)
    min_ps = [0.05, 0.3, 0.9, 0.0] * (rows // 4)
    temperature = 1.3
    params = [SamplingParams(temperature=temperature, min_p=m) for m in min_ps]
    out = sampler(logits, build_metadata(params, vocab, default_generator=make_generator(5, DEVICE)))
    probs = torch.softmax(logits / temperature, -1)  # min_p applies after temperature
    for row, m in enumerate(min_ps):
        tok = out.sampled_token_ids[row].item()
        assert probs[row, tok] >= m * probs[row].max() * (1 - 1e-5)


def test_restricted_distribution_matches(sampler):
    """top_k renormalises over the kept tokens: frequencies follow the truncated softmax."""
    vocab, rows = 10, 30_000
    base = torch.linspace(1.0, -1.0, vocab)
    logits = base.expand(rows, vocab).contiguous()
    params = [SamplingParams(temperature=0.7, top_k=4)] * rows
    out = sampler(logits, build_metadata(params, vocab, default_generator=make_generator(6, DEVICE)))
    probs = torch.zeros(vocab)
    probs[:4] = torch.softmax(base[:4] / 0.7, -1)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).float()
    assert counts[4:].sum() == 0
    assert _chi_square(counts, probs) < 25.0  # 3 degrees of freedom


# --------------------------------------------------------------------------------------- penalties


def reference_penalties(logits: torch.Tensor, params, prompts, outputs) -> torch.Tensor:
    out = logits.clone().double()
    for row, p in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for tok in seen:
            v = out[row, tok].item()
            out[row, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(outputs[row]):
            cnt = outputs[row].count(tok)
            out[row, tok] -= p.frequency_penalty * cnt + p.presence_penalty
    return out.float()


def test_penalties_match_reference(sampler):
    vocab = 25
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.7),
        SamplingParams(temperature=0.0, presence_penalty=1.1),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.4),
        SamplingParams(temperature=0.0),  # no penalty in a penalised batch
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0),
    ]
    prompts = [[1, 2, 3, 3], [4], [], [5, 6, 7, 8, 9, 24], [0], [10, 11]]
    outputs = [[3, 3, 12], [4, 4, 4, 13], [14, 14, 15], [], [0, 0], [10, 10, 16, 24]]
    torch.manual_seed(0)
    for trial in range(20):
        logits = rand_logits(len(params), vocab, seed=100 + trial)
        ref = reference_penalties(logits, params, prompts, outputs)
        md = build_metadata(params, vocab, outputs=outputs, prompts=prompts)
        # Capture the processed logits through the greedy argmax and through a direct call.
        processed = logits.clone()
        Sampler._apply_penalties(processed, md)
        torch.testing.assert_close(processed, ref, atol=1e-5, rtol=1e-5)
        out = sampler(logits, md)
        assert torch.equal(out.sampled_token_ids, ref.argmax(-1))


def test_penalties_change_greedy_choice(sampler):
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5)]
    assert (
        sampler(logits, build_metadata(params, 4, outputs=[[0]], prompts=[[]])).sampled_token_ids.item() == 1
    )
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    assert (
        sampler(logits, build_metadata(params, 4, outputs=[[]], prompts=[[0, 3]])).sampled_token_ids.item()
        == 1
    )


# -------------------------------------------------------------------------------------- min_tokens


def test_min_tokens_bans_stop_ids_until_reached(sampler):
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 10.0  # EOS is by far the most likely
    logits[:, 2] = 9.0  # a user stop id, second
    logits[:, 4] = 8.0  # best token once the stop ids are banned
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]) for _ in range(3)]
    outputs = [[1], [1, 1], [1, 1, 1]]  # row 2 has reached min_tokens
    out = sampler(logits, build_metadata(params, vocab, outputs=outputs, eos_token_ids=frozenset({7})))
    assert out.sampled_token_ids.tolist() == [4, 4, 7]
    assert logits[0, 7] == 10.0  # the caller's logits are untouched
    # Random rows never sample banned ids either.
    params_r = [SamplingParams(temperature=1.0, min_tokens=5) for _ in range(500)]
    logits_r = torch.zeros(500, vocab)
    logits_r[:, 7] = 5.0
    out = sampler(
        logits_r,
        build_metadata(
            params_r,
            vocab,
            outputs=[[0]] * 500,
            default_generator=make_generator(7, DEVICE),
            eos_token_ids=frozenset({7, 2}),
        ),
    )
    assert not ((out.sampled_token_ids == 7) | (out.sampled_token_ids == 2)).any()


# -------------------------------------------------------------------------------- seeds, batching


def _run_seeded_steps(sampler, logits_rows: list[torch.Tensor], seeds: dict[int, int], params, steps: int):
    """Runs `steps` engine steps for one fixed batch; returns the token sequences per row."""
    gens = {row: make_generator(seed, DEVICE) for row, seed in seeds.items()}
    logits = torch.stack(logits_rows)
    vocab = logits.shape[1]
    seqs = [[] for _ in logits_rows]
    for _ in range(steps):
        md = build_metadata(params, vocab, generators=gens, default_generator=make_generator(999, DEVICE))
        toks = sampler(logits, md).sampled_token_ids.tolist()
        for row, tok in enumerate(toks):
            seqs[row].append(tok)
    return seqs


def test_seeded_row_independent_of_batch(sampler):
    vocab = 200
    target = rand_logits(1, vocab, seed=20, scale=1.0)[0]  # flat-ish: many plausible tokens
    others = rand_logits(6, vocab, seed=21, scale=1.0)
    target_params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    other_params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, seed=7, top_k=20),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, seed=42),  # same seed, different request
        SamplingParams(temperature=1.0),
    ]
    steps = 8
    alone = _run_seeded_steps(sampler, [target], {0: 42}, [target_params], steps)[0]
    assert len(set(alone)) > 1  # really random, not a degenerate constant

    layouts = [
        [0, 1],  # target first, small batch
        [1, 2, 0],  # target in the middle
        [2, 3, 4, 5, 0],  # target last, several seeded neighbours
        [5, 4, 3, 2, 1, 0, 6],  # different order and size
    ]
    for layout in layouts:
        # Index 0 is the target; index i > 0 is others[i - 1].
        rows = [target if i == 0 else others[i - 1] for i in layout]
        params = [target_params if i == 0 else other_params[i - 1] for i in layout]
        seeds = {pos: p.seed for pos, p in enumerate(params) if p.seed is not None}
        seqs = _run_seeded_steps(sampler, rows, seeds, params, steps)
        assert seqs[layout.index(0)] == alone, layout


def test_seeded_generator_reproducible_across_runs(sampler):
    logits = rand_logits(1, 100, seed=30, scale=1.0)
    params = [SamplingParams(temperature=1.0, seed=5)]
    a = _run_seeded_steps(sampler, [logits[0]], {0: 5}, params, 5)
    b = _run_seeded_steps(sampler, [logits[0]], {0: 5}, params, 5)
    c = _run_seeded_steps(sampler, [logits[0]], {0: 6}, params, 5)
    assert a == b
    assert a != c


def test_all_rows_seeded_skips_default_rng(sampler):
    logits = rand_logits(3, 50, seed=31, scale=1.0)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    default = make_generator(0, DEVICE)
    state = default.get_state()
    gens = {i: make_generator(s, DEVICE) for i, s in enumerate((1, 2, 3))}
    sampler(logits, build_metadata(params, 50, generators=gens, default_generator=default))
    assert torch.equal(default.get_state(), state)


def test_mixed_greedy_and_random(sampler):
    vocab, rows = 50, 400
    logits = rand_logits(rows, vocab, seed=40, scale=1.0)
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0, top_k=10)
        for i in range(rows)
    ]
    out = sampler(logits, build_metadata(params, vocab, default_generator=make_generator(8, DEVICE)))
    greedy_rows = torch.arange(0, rows, 2)
    random_rows = torch.arange(1, rows, 2)
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(-1))
    # Random rows stay inside their top-10 and are not all argmax.
    rnd = out.sampled_token_ids[random_rows]
    top10 = logits[random_rows].topk(10).indices
    assert (top10 == rnd[:, None]).any(-1).all()
    assert (rnd != logits[random_rows].argmax(-1)).float().mean() > 0.3


def test_metadata_flags_for_fast_path(sampler):
    """All features off: the sampler returns argmax without touching any optional tensor."""
    logits = rand_logits(5, 30, seed=50)
    md = SamplingMetadata(
        temperature=torch.zeros(5),
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        min_p=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        output_token_ids=[[] for _ in range(5)],
        frequency_penalties=None,
        presence_penalties=None,
        repetition_penalties=None,
        min_tokens={},
    )
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_make_generator():
    g1, g2 = make_generator(123, "cpu"), make_generator(123, torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    assert g1.device.type == "cpu"
    assert not math.isnan(torch.empty(3).exponential_(generator=g1).sum().item())
