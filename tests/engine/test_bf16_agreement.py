"""The engine in bfloat16 against HF transformers in float32 on the same weights, and prefix-cache hits
against cold prefills in bfloat16: tolerances and agreement rates, not exact parity.

Exact parity is a float32 claim (test_engine_parity.py). In bfloat16 every matmul output, K/V entry and
activation keeps 8 bits of mantissa: the logits move by about 1e-2 relative, and a greedy step whose top
two candidates are closer than that may pick the other one. Everything runs on the test device
(KVFLEET_TEST_DEVICE); the reference is HF in float32 with eager attention on the same device.

(a) Teacher forcing: for each prompt and each position of HF's greedy continuation, the engine gets the
    prompt plus HF's tokens so far and returns one token with its top-20 logprobs. HF's token must be
    among them, with a logprob within LOGPROB_ATOL of HF's float32 log_softmax (LOGPROB_MEAN_ATOL on
    average over the positions).
(b) Greedy agreement: the engine's argmax is HF's at TEACHER_FORCED_FLOOR of those positions, and at
    every position where HF's top-2 logprob gap is over CONFIDENT_GAP. Free-running, the tokens generated
    before each prompt's first divergence from HF are FREE_RUNNING_FLOOR of all generated tokens.
(c) Prefix-cache hit vs cold prefill (both bfloat16, the same prompts): with the prompts' blocks cached,
    a request computes only its tail, in other matmul shapes than a cold prefill of the whole prompt.
    Teacher-forced next tokens agree at HIT_TEACHER_FORCED_FLOOR of the positions (logprobs within
    LOGPROB_ATOL), free-running continuations at HIT_FREE_RUNNING_FLOOR; a cold engine run twice is
    identical (the baseline that makes the comparison mean something).

The floors are regression guards, not exactness claims: each was set from a CPU measurement (the
numbers are beside it) with a margin, so that a broken bfloat16 path (a wrong cast, a K/V cache in the
wrong dtype, a cached prefix read at the wrong positions) fails them while bfloat16's own rounding does
not. Run with ``-s`` to see this device's rates. The prefix-hit floors are per device: on the CPU a hit
changed 1 next token in 768, so its floors are tight; on a GPU other kernels (cuBLAS, Triton) round
differently and a hit has been seen to change greedy tokens (H100), so there the floors are the
bfloat16-vs-float32 ones, a hit's re-rounding being a smaller perturbation than bfloat16 itself.

Models: the ``tiny`` llama and qwen2 (biases, tied embeddings) with the default ``logit_std`` (8). A
larger ``logit_std`` makes the logits no more decisive against bfloat16: its errors are relative, so
logits, errors and gaps all scale together (measured on llama, 192 teacher-forced positions: with 64
the same 9 flips as with 8, and logprob differences up to 6x larger).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kvfleet_engine import LLM, SamplingParams

NUM_NEW = 16  # HF greedy tokens per prompt: teacher-forced positions and free-running length
NUM_RANDOM = 21  # prompts of random tokens, besides 3 with a shared 3-block prefix
TOP_N = 20  # the engine's largest logprobs count
BLOCK_SIZE = 16

# CPU measurements: llama / qwen2, 24 prompts x 16 positions each.
# (a) |engine bf16 - HF fp32| logprob of HF's token, in nats (logit_std 8). CPU: max 0.93 / 0.77, mean
# 0.104 / 0.087.
LOGPROB_ATOL = 1.5
LOGPROB_MEAN_ATOL = 0.25
# (b) CPU: teacher-forced 0.943 / 0.961 of the positions; free-running 0.701 / 0.701 of the tokens.
TEACHER_FORCED_FLOOR = 0.90
# A top-2 gap wider than twice the logprob tolerance cannot flip while (a) holds for both tokens. CPU: the
# engine's top-2 gaps were off HF's by up to 1.87 nats (p99 1.44), and flips came at gaps up to 1.08.
CONFIDENT_GAP = 2 * LOGPROB_ATOL
FREE_RUNNING_FLOOR = 0.5
# (c) CPU: teacher-forced 1.000 / 0.997 (|logprob diff| max 0.06 / 0.09), free-running 1.000 / 1.000.
# CUDA: not measured here yet; the bfloat16-vs-float32 floors (see the module docstring).
HIT_TEACHER_FORCED_FLOOR = {"cpu": 0.97, "cuda": TEACHER_FORCED_FLOOR}
HIT_FREE_RUNNING_FLOOR = {"cpu": 0.8, "cuda": FREE_RUNNING_FLOOR}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab - 4) for _ in range(48)]  # three prompts share 3 blocks
    prompts = [shared + [rng.randrange(3, vocab - 4) for _ in range(k)] for k in (3, 17, 40)]
    prompts += [
        [rng.randrange(3, vocab - 4) for _ in range(rng.randrange(20, 100))] for _ in range(NUM_RANDOM)
    ]
    return prompts


@torch.inference_mode()
def _hf_greedy(hf, prompt: list[int], device: str) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and its float32 log_softmax at each step ([NUM_NEW, vocab], on the CPU).
    Each step runs the whole sequence again (no KV cache: the plainest reference, and cheap at this size)."""
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(NUM_NEW):
        logits = hf(torch.tensor([prompt + tokens], device=device), use_cache=False).logits
        lp = torch.log_softmax(logits[0, -1].float(), dim=-1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp.cpu())
    return tokens, torch.stack(logprobs)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Runs:
    label: str  # "<arch> on <device>"
    device_type: str  # "cpu" or "cuda": picks the prefix-hit floors
    prompts: list[list[int]]
    hf_tokens: list[list[int]]  # per prompt
    hf_logprobs: list[torch.Tensor]  # per prompt, [NUM_NEW, vocab]
    cold_tf: list  # teacher-forced RequestOutputs, prompt-major, cold prefills (no prefix caching)
    hit_tf: list  # the same requests with their prompts' blocks cached
    cold_free: list[list[int]]
    cold_free_again: list[list[int]]
    hit_free: list[list[int]]
    hit_free_cached: list[int]  # num_cached_tokens of each free-running request with hits


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runs(request, demo_model, hf_float32, test_device) -> Runs:
    path = demo_model(arch=request.param)
    hf = hf_float32(path)
    prompts = _prompts(hf.config.vocab_size)
    hf_tokens, hf_logprobs = zip(*(_hf_greedy(hf, p, test_device) for p in prompts))
    del hf

    kw = {"device": test_device, "dtype": "bfloat16", "block_size": BLOCK_SIZE, "use_tqdm": False}
    cold = LLM(path, enable_prefix_caching=False, **kw)
    cached = LLM(path, enable_prefix_caching=True, **kw)
    assert cold.config.dtype == cached.config.dtype == torch.bfloat16

    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP_N, ignore_eos=True)
    greedy = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    teacher = [
        {"prompt_token_ids": p + ref[:k]} for p, ref in zip(prompts, hf_tokens) for k in range(NUM_NEW)
    ]
    free = [{"prompt_token_ids": p} for p in prompts]

    cold_tf = cold.generate(teacher, one, use_tqdm=False)
    cold_free = [o.outputs[0].token_ids for o in cold.generate(free, greedy, use_tqdm=False)]
    cold_free_again = [o.outputs[0].token_ids for o in cold.generate(free, greedy, use_tqdm=False)]
    # Warm the cache with every prompt followed by HF's whole continuation: each teacher-forced request
    # then finds all its full blocks but the one holding its last token cached.
    cached.generate(
        [{"prompt_token_ids": p + ref} for p, ref in zip(prompts, hf_tokens)], one, use_tqdm=False
    )
    hit_tf = cached.generate(teacher, one, use_tqdm=False)
    hit_free_out = cached.generate(free, greedy, use_tqdm=False)
    return Runs(
        label=f"{request.param} on {test_device}",
        device_type=torch.device(test_device).type,
        prompts=prompts,
        hf_tokens=list(hf_tokens),
        hf_logprobs=list(hf_logprobs),
        cold_tf=cold_tf,
        hit_tf=hit_tf,
        cold_free=cold_free,
        cold_free_again=cold_free_again,
        hit_free=[o.outputs[0].token_ids for o in hit_free_out],
        hit_free_cached=[o.num_cached_tokens for o in hit_free_out],
    )


def _positions(runs: Runs):
    """(prompt index, step, HF token, HF logprobs at that step, engine cold output, engine hit output)."""
    i = 0
    for pi, ref in enumerate(runs.hf_tokens):
        for k in range(NUM_NEW):
            yield (
                pi,
                k,
                ref[k],
                runs.hf_logprobs[pi][k],
                runs.cold_tf[i].outputs[0],
                runs.hit_tf[i].outputs[0],
            )
            i += 1


def test_teacher_forced_logprobs_within_tolerance(runs):
    diffs = []
    for pi, k, tok, ref, cold, _ in _positions(runs):
        entry = cold.logprobs[0]
        assert tok in entry, f"prompt {pi} step {k}: HF's token {tok} is not in the engine's top {TOP_N}"
        diffs.append(abs(entry[tok].logprob - ref[tok].item()))
    d = torch.tensor(diffs)
    print(
        f"\n[bf16 vs fp32 HF, {runs.label}] teacher-forced |logprob diff| of HF's token over {len(d)} "
        f"positions: max {d.max():.3f}, p99 {d.quantile(0.99):.3f}, median {d.median():.3f}, mean {d.mean():.3f}"
    )
    worst = int(d.argmax())
    assert d.max() <= LOGPROB_ATOL, f"position {divmod(worst, NUM_NEW)}: {d.max():.3f} > {LOGPROB_ATOL}"
    assert d.mean() <= LOGPROB_MEAN_ATOL


def test_greedy_agreement_rates_above_floors(runs):
    agree, confident, flips = 0, 0, []
    for pi, k, tok, ref, cold, _ in _positions(runs):
        top2 = torch.topk(ref, 2).values
        gap = float(top2[0] - top2[1])
        same = cold.token_ids[0] == tok
        agree += same
        confident += gap > CONFIDENT_GAP
        if not same:
            flips.append((pi, k, round(gap, 3)))
    total = len(runs.prompts) * NUM_NEW
    rate = agree / total
    before_divergence = [_common_prefix(e, r) for e, r in zip(runs.cold_free, runs.hf_tokens)]
    free_rate = sum(before_divergence) / total
    print(
        f"\n[bf16 vs fp32 HF, {runs.label}] teacher-forced greedy agreement {agree}/{total} = {rate:.3f} "
        f"(flips as (prompt, step, HF top-2 gap): {flips}); free-running: {free_rate:.3f} of the tokens "
        f"before the first divergence (per prompt: {before_divergence} of {NUM_NEW})"
    )
    assert confident >= total // 5  # a fair share of the positions (CPU: 24 %), not a handful
    assert not [f for f in flips if f[2] > CONFIDENT_GAP], f"flips where HF was confident: {flips}"
    assert rate >= TEACHER_FORCED_FLOOR
    assert free_rate >= FREE_RUNNING_FLOOR


def test_prefix_hit_vs_cold_prefill_agreement(runs):
    # The baseline: without prefix caching the same batch gives the same tokens every time.
    assert runs.cold_free_again == runs.cold_free
    # The hit runs did hit: every request longer than a block found cached blocks.
    hit_cached = [o.num_cached_tokens for o in runs.hit_tf]
    assert all(c > 0 for c, o in zip(hit_cached, runs.hit_tf) if len(o.prompt_token_ids) > BLOCK_SIZE)
    assert all(c > 0 for c in runs.hit_free_cached)
    assert all(o.num_cached_tokens == 0 for o in runs.cold_tf)
    served = sum(hit_cached) / sum(len(o.prompt_token_ids) for o in runs.hit_tf)

    agree, diffs = 0, []
    for pi, k, _, _, cold, hit in _positions(runs):
        tok = cold.token_ids[0]
        agree += hit.token_ids[0] == tok
        assert tok in hit.logprobs[0], (
            f"prompt {pi} step {k}: the cold argmax is not in the hit's top {TOP_N}"
        )
        diffs.append(abs(hit.logprobs[0][tok].logprob - cold.logprobs[0][tok].logprob))
    total = len(runs.prompts) * NUM_NEW
    rate = agree / total
    d = torch.tensor(diffs)
    before_divergence = [_common_prefix(h, c) for h, c in zip(runs.hit_free, runs.cold_free)]
    free_rate = sum(before_divergence) / total
    positionwise = sum(x == y for h, c in zip(runs.hit_free, runs.cold_free) for x, y in zip(h, c)) / total
    print(
        f"\n[bf16 prefix hit vs cold prefill, {runs.label}] teacher-forced next-token agreement "
        f"{agree}/{total} = {rate:.3f} ({served:.0%} of the prompt tokens from the cache; |logprob diff| "
        f"max {d.max():.3f}, mean {d.mean():.4f}); free-running: {free_rate:.3f} of the tokens before the "
        f"first divergence, {positionwise:.3f} position-wise (per prompt: {before_divergence} of {NUM_NEW})"
    )
    assert d.max() <= LOGPROB_ATOL
    assert rate >= HIT_TEACHER_FORCED_FLOOR[runs.device_type]
    assert free_rate >= HIT_FREE_RUNNING_FLOOR[runs.device_type]
