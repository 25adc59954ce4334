"""The simulated executor: its timing model, deterministic tokens, and the real engine around it.

No wall-clock assertions: step costs are checked through ``SimulatedExecutor.step_log`` (what the
timing model charged each step, from the scheduler's real token counts).
"""

from __future__ import annotations

import math

import pytest

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.engine_args import DEFAULT_SIMULATED_KV_BLOCKS, EngineArgs, SimulationCost
from kvfleet_engine.executor.simulated import SimulatedExecutor, step_seconds

# Small but non-zero costs: every step really sleeps, and the tests stay fast.
COST = SimulationCost(
    prefill_ms_per_1k_tokens=2.0, decode_ms_per_step=0.5, decode_ms_per_seq=0.01, step_overhead_ms=0.1
)


# ---- the timing model (pure) --------------------------------------------------------------------


def test_step_seconds_adds_overhead_prefill_and_decode_costs():
    cost = SimulationCost(
        prefill_ms_per_1k_tokens=50, decode_ms_per_step=15, decode_ms_per_seq=0.5, step_overhead_ms=1
    )
    assert step_seconds(cost, 2000, 0) == pytest.approx(0.101)  # 2,000 uncached tokens: 1 + 100 ms
    assert step_seconds(cost, 0, 8) == pytest.approx(0.020)  # 1 + 15 + 8 x 0.5 ms
    assert step_seconds(cost, 500, 4) == pytest.approx(0.043)  # 1 + 25 + 15 + 2 ms
    assert step_seconds(cost, 0, 0) == 0.0  # a step that computes nothing costs nothing


def test_defaults_model_a_small_gpu_replica():
    d = SimulationCost()
    assert step_seconds(d, 2000, 0) == pytest.approx(0.101)  # ~20k prefill tokens/s
    assert 0.015 <= step_seconds(d, 0, 1) <= 0.02  # ~15 ms decode step


def test_zero_cost_is_free_and_bad_costs_are_refused():
    zero = SimulationCost(0, 0, 0, 0)
    assert step_seconds(zero, 4096, 256) == 0.0
    for bad in ({"decode_ms_per_step": -1.0}, {"step_overhead_ms": math.nan}, {"decode_ms_per_seq": "1"}):
        with pytest.raises(ValueError, match="simulation cost"):
            SimulationCost(**bad)


# ---- configuration --------------------------------------------------------------------------------


def test_config_of_a_simulated_replica(demo_model):
    path = demo_model("llama", "tiny")
    cfg = EngineConfig.create(EngineArgs(path, simulation={"decode_ms_per_step": 3.0}))
    assert cfg.simulation == SimulationCost(decode_ms_per_step=3.0)
    assert cfg.device == "cpu" and cfg.distributed_executor_backend == "uni"
    assert cfg.num_kv_blocks == DEFAULT_SIMULATED_KV_BLOCKS
    assert cfg.max_num_batched_tokens == 8192  # a GPU replica's budget: a 2,200-token prompt is one step
    # No positions are computed: a simulated replica may exceed the model's position limit (4096).
    long = EngineConfig.create(EngineArgs(path, simulation=COST, max_model_len=16384, num_kv_blocks=2048))
    assert long.max_model_len == 16384 and long.num_kv_blocks == 2048
    with pytest.raises(ValueError, match="exceeds"):
        EngineConfig.create(EngineArgs(path, max_model_len=16384))  # the real engine still refuses
    for bad, match in (
        ({"device": "cuda"}, "CPU"),
        ({"tensor_parallel_size": 2}, "one process"),
        ({"kv_cache_memory_bytes": 1 << 20}, "num_kv_blocks"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig.create(EngineArgs(path, simulation=COST, **bad))
    with pytest.raises(ValueError, match="bad simulation costs"):
        EngineConfig.create(EngineArgs(path, simulation={"prefill_tokens_per_s": 1.0}))


# ---- the offline engine with a simulated executor -------------------------------------------------


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model("llama", "tiny"), use_tqdm=False, simulation=COST, max_model_len=1024)


def executor(llm: LLM) -> SimulatedExecutor:
    ex = llm.engine.executor
    assert isinstance(ex, SimulatedExecutor)
    return ex


def no_leaks(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert not llm.engine.has_unfinished_requests()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
    assert not executor(llm).requests


PROMPT = "The lighthouse keeper walked along the shore at dawn, counting the boats that came back. " * 3


def test_no_model_is_built(llm):
    ex = executor(llm)
    assert not hasattr(ex, "worker")
    report = ex.memory_report()  # what a GPU replica would hold, for the device-memory metrics
    assert report["kv_cache"] == DEFAULT_SIMULATED_KV_BLOCKS * llm.config.kv_bytes_per_block
    assert report["weights"] == 721_472 * 4  # the tiny llama's parameters in float32


def test_tokens_are_deterministic_ordinary_and_decode_to_text(llm):
    sp = SamplingParams(max_tokens=24, temperature=1.0)
    a, b, other = llm.generate([PROMPT, PROMPT, "A quiet morning in the city"], sp, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids  # same prompt, same tokens
    assert a.outputs[0].token_ids != other.outputs[0].token_ids  # another prompt, other tokens
    tok = llm.get_tokenizer()
    specials = set(tok.all_special_ids) | set(llm.config.model.eos_token_ids)
    for out in (a, b, other):
        c = out.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length"  # never an EOS: runs to max_tokens
        assert not specials & set(c.token_ids)
        assert c.text.strip() and "\ufffd" not in c.text
        assert c.text == tok.decode(c.token_ids)
    # seeded n > 1 siblings differ from each other; the same seed gives the same tokens again
    seeded = SamplingParams(n=2, seed=5, max_tokens=8)
    first, again = (llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs for _ in range(2))
    assert first[0].token_ids != first[1].token_ids
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    no_leaks(llm)


def test_stop_token_ids_are_never_emitted(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids
    banned = plain[:4]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=banned), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert not set(banned) & set(out.token_ids)
    no_leaks(llm)


def test_step_costs_follow_the_scheduler_and_prefix_hits(llm):
    ex = executor(llm)
    llm.reset_prefix_cache()
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    n = len(prompt_ids)
    ex.step_log.clear()
    first = llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    steps = list(ex.step_log)
    # one prefill step of the whole prompt (it samples the first token), then 3 one-sequence decodes
    assert [(s.prefill_tokens, s.num_decodes) for s in steps if s.seconds] == [(n, 0), (0, 1), (0, 1), (0, 1)]
    for s in steps:
        assert s.seconds == pytest.approx(step_seconds(COST, s.prefill_tokens, s.num_decodes))

    ex.step_log.clear()
    second = llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)[0]
    cached = second.num_cached_tokens
    assert cached > 0 and cached % llm.config.block_size == 0  # whole blocks, never the last token
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # only the uncached tail of the prompt is charged as prefill
    assert next(s.prefill_tokens for s in ex.step_log if s.prefill_tokens) == n - cached
    no_leaks(llm)


def test_batched_decodes_are_charged_per_step_and_per_sequence(llm):
    ex = executor(llm)
    ex.step_log.clear()
    prompts = [f"Request number {i} asks about the weather" for i in range(5)]
    llm.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
    decode_steps = [s for s in ex.step_log if s.num_decodes]
    assert max(s.num_decodes for s in decode_steps) == 5
    assert sum(s.num_decodes for s in decode_steps) == 5 * 5  # 6 tokens each: 1 from prefill, 5 decoded
    full = next(s for s in decode_steps if s.num_decodes == 5 and not s.prefill_tokens)
    assert full.seconds == pytest.approx((0.1 + 0.5 + 5 * 0.01) / 1000)
    no_leaks(llm)


def test_measured_rates_never_beat_the_modelled_device(llm):
    # time.sleep never returns early, so what StepRates measures is at most what the model allows.
    llm.reset_prefix_cache()
    llm.generate([f"{i} {PROMPT}" for i in range(3)], SamplingParams(max_tokens=1), use_tqdm=False)
    rates = llm.engine.rates
    assert 0 < rates.prefill_tokens_per_s <= 1000 / (COST.prefill_ms_per_1k_tokens / 1000)


def test_logprobs_are_synthetic_but_consistent(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, top in zip(out.token_ids, out.logprobs):
        assert top[tok].rank == 1 and top[tok].logprob == pytest.approx(-math.log(2))
        assert sorted(lp.rank for lp in top.values()) == [1, 2, 3]
        assert sum(math.exp(lp.logprob) for lp in top.values()) < 1
    no_leaks(llm)


def test_chunked_prefill_and_preemption_keep_the_same_tokens(demo_model):
    path = demo_model("llama", "tiny")
    sp = SamplingParams(max_tokens=40)
    prompts = [f"{i}: {PROMPT}" for i in range(4)]
    base = LLM(path, use_tqdm=False, simulation=SimulationCost(0, 0, 0, 0), max_model_len=256)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]

    chunked = LLM(path, use_tqdm=False, simulation=SimulationCost(0, 0, 0, 0), max_model_len=256,
                  max_num_batched_tokens=32)  # fmt: skip
    got = chunked.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert max(s.prefill_tokens for s in executor(chunked).step_log) <= 32

    # 4 x (84 prompt + 40 output) tokens do not fit in 23 usable blocks of 16: preemption and recompute
    tight = LLM(
        path, use_tqdm=False, simulation=SimulationCost(0, 0, 0, 0), max_model_len=256, num_kv_blocks=24
    )
    got = tight.generate(prompts, sp, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == expected
    no_leaks(tight)


def test_sleep_and_wake(llm):
    before = llm.generate(PROMPT, SamplingParams(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(1)
    ex = executor(llm)
    assert llm.is_sleeping and ex.memory_report() == {"weights": 0, "kv_cache": 0}
    llm.wake_up(["weights"])
    assert llm.is_sleeping and ex.memory_report()["weights"] > 0 and ex.memory_report()["kv_cache"] == 0
    llm.wake_up()
    assert not llm.is_sleeping and ex.memory_report()["kv_cache"] > 0
    after = llm.generate(PROMPT, SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert after.num_cached_tokens == 0  # sleep emptied the prefix cache
    assert after.outputs[0].token_ids == before
    no_leaks(llm)
