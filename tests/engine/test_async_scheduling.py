"""Async scheduling (``EngineCore._step_async``): step n+1 is scheduled and launched before step n's tokens
reach the host, and what every request gets is exactly what step-by-step scheduling gives it.

Checked on the test device in float32 against the same engine without it: greedy and seeded sampling,
stops by EOS-like stop ids, max_tokens and stop strings (a request finishing while its next step is already
launched), requests that must go step by step (penalties, min_tokens), logprobs, n > 1, chunked prefill,
preemption, prefix hits, and the decode-graph path. Each case also shows that steps did run ahead (a
launch fed a token that was still being sampled).
"""

from __future__ import annotations

import random

import pytest

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.worker.cuda_graph import eager_capture


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randrange(3, 40))]} for _ in range(n)
    ]


def _params(stop_ids: list[int]) -> list[SamplingParams]:
    greedy = dict(temperature=0.0)
    return [
        SamplingParams(max_tokens=24, ignore_eos=True, **greedy),
        SamplingParams(max_tokens=1, ignore_eos=True, **greedy),
        SamplingParams(max_tokens=2, ignore_eos=True, **greedy),
        SamplingParams(max_tokens=30, stop_token_ids=stop_ids, **greedy),  # stops mid-way
        SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.3, **greedy),
        SamplingParams(max_tokens=12, min_tokens=8, stop_token_ids=stop_ids, **greedy),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=12, ignore_eos=True, n=2),
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, **greedy),
        SamplingParams(max_tokens=18, ignore_eos=True, **greedy),
    ]


def _outputs(outs) -> list[tuple]:
    """Prompt, then per completion its tokens, finish and stop reasons, and its logprobs' token ids (the
    values are compared apart, with a tolerance: a different batch shape rounds float32 differently)."""
    return [
        (
            o.prompt_token_ids,
            [
                (
                    c.token_ids,
                    c.finish_reason,
                    c.stop_reason,
                    None if c.logprobs is None else [list(e) for e in c.logprobs],
                )
                for c in o.outputs
            ],
        )
        for o in outs
    ]


def _logprob_values(outs) -> list[float]:
    return [lp.logprob for o in outs for c in o.outputs for e in (c.logprobs or []) for lp in e.values()]


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (outputs, values), (want_outputs, want_values) in zip(got, want):
        assert outputs == want_outputs
        assert values == pytest.approx(want_values, abs=1e-3)


def _run(path, device, params, prompts, rounds=1, graphs=False, **kw) -> tuple[list, int]:
    llm = LLM(path, use_tqdm=False, device=device, dtype="float32", max_model_len=256, **kw)
    runner = llm.engine.executor.worker.runner
    if graphs:
        runner.use_decode_graphs(eager_capture)
    fed = []
    feed = runner._feed_pending_tokens

    def counted(step):
        out = feed(step)
        if out is not None:
            fed.append(len(out[0]))
        return out

    runner._feed_pending_tokens = counted
    try:
        results = []
        for _ in range(rounds):
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append((_outputs(outs), _logprob_values(outs)))
        assert llm.num_free_kv_blocks == llm.engine.num_kv_blocks - 1  # nothing leaked
        assert not llm.engine.has_pending_work()
    finally:
        llm.shutdown()
    return results, sum(fed)


@pytest.fixture(scope="module")
def stop_ids(demo_model, test_device) -> list[int]:
    """Two tokens the greedy run of request 3 produces at steps 6 and 9: a stop id ends it early."""
    llm = LLM(
        demo_model(arch="qwen2"), use_tqdm=False, device=test_device, dtype="float32", max_model_len=256
    )
    [out] = llm.generate(_prompts(4)[3:4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    tokens = out.outputs[0].token_ids
    return [tokens[6], tokens[9]]


@pytest.mark.parametrize(
    "engine_kw",
    [
        pytest.param({"max_num_seqs": 16}, id="plain"),
        pytest.param({"max_num_seqs": 6, "max_num_batched_tokens": 32}, id="chunked-few-seqs"),
        pytest.param({"num_kv_blocks": 40, "block_size": 8, "max_num_batched_tokens": 48}, id="preemption"),
    ],
)
def test_async_outputs_equal_step_by_step(demo_model, test_device, stop_ids, engine_kw):
    path = demo_model(arch="qwen2")
    prompts = _prompts(10)
    params = _params(stop_ids)
    sync, fed_sync = _run(path, test_device, params, prompts, rounds=2, **engine_kw)
    run_ahead, fed = _run(path, test_device, params, prompts, rounds=2, async_scheduling=True, **engine_kw)
    assert fed_sync == 0
    assert fed > 0, "no step ran ahead"
    _assert_same(run_ahead, sync)  # round 2 hits the prefix cache
    stopped = sync[0][0][3][1][0]
    assert stopped[1] == "stop" and len(stopped[0]) < 30


def test_async_through_the_decode_graph_buffers(demo_model, test_device, stop_ids):
    path = demo_model(arch="qwen2")
    prompts, params = _prompts(10, seed=1), _params(stop_ids)
    sync, _ = _run(path, test_device, params, prompts, max_num_seqs=16)
    run_ahead, fed = _run(
        path, test_device, params, prompts, graphs=True, async_scheduling=True, max_num_seqs=16
    )
    assert fed > 0
    _assert_same(run_ahead, sync)


def test_a_stop_string_ends_a_request_whose_next_step_is_in_flight(demo_model, test_device):
    path = demo_model(arch="qwen2")
    prompts = _prompts(6, seed=2)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(use_tqdm=False, device=test_device, dtype="float32", max_model_len=256)
    llm = LLM(path, **kw)
    texts = [o.outputs[0].text for o in llm.generate(prompts, plain, use_tqdm=False)]
    llm.shutdown()
    stops = [t[len(t) // 2 : len(t) // 2 + 3] for t in texts]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[s]) for s in stops]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(path, async_scheduling=async_scheduling, **kw)
        results.append(
            [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
        )
        assert llm.num_free_kv_blocks == llm.engine.num_kv_blocks - 1
        llm.shutdown()
    assert results[1] == results[0]
    assert all(reason == "stop" for _, reason in results[0])


def test_sleep_and_reset_with_a_step_in_flight(demo_model, test_device):
    llm = LLM(demo_model(arch="qwen2"), use_tqdm=False, device=test_device, dtype="float32", max_model_len=256,
              async_scheduling=True)  # fmt: skip
    prompts = _prompts(4, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = _outputs(llm.generate(prompts, params))
    engine = llm.engine
    for p in prompts:
        llm._add_request(p, params, 0)
    engine.step()
    engine.step()
    assert engine._launched is not None
    outputs = engine.sleep(1)
    assert {o.request_id for o in outputs if o.finish_reason == "abort"}
    assert engine._launched is None and not engine.has_unfinished_requests()
    finished, _ = llm.output_processor.process_outputs(outputs)  # as LLM.sleep's caller would
    assert {o.request_id for o in finished} == {str(i) for i in range(len(prompts), 2 * len(prompts))}
    assert all(o.outputs[0].finish_reason == "abort" for o in finished)
    llm.wake_up()
    assert _outputs(llm.generate(prompts, params)) == before
    assert llm.reset_prefix_cache()
    llm.shutdown()


def test_async_scheduling_needs_one_in_process_rank(demo_model):
    with pytest.raises(ValueError, match="async_scheduling needs one rank"):
        LLM(demo_model(), device="cpu", async_scheduling=True, distributed_executor_backend="mp")


def test_the_server_runs_ahead_too(demo_model, test_device, tmp_path):
    """`kvfleet engine serve --async-scheduling`: the engine core process's loop, the same answers."""
    import httpx

    from tests.server.server_harness import run_server

    path = demo_model(arch="qwen2")
    prompts = [p["prompt_token_ids"] for p in _prompts(8, seed=4)]
    llm = LLM(path, use_tqdm=False, device=test_device, dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm.shutdown()
    flags = ("--max-model-len", "256", "--device", test_device, "--dtype", "float32", "--async-scheduling")
    with run_server(path, tmp_path, *flags) as server:
        body = {
            "model": server.model,
            "prompt": prompts,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        got = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
        assert "async scheduling: each step is scheduled while the one before it runs" in server.log()
    assert got == want and all(got)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requests_arriving_and_aborted_while_steps_are_in_flight(demo_model, test_device, seed):
    """Requests join and are aborted between steps, so some aborts hit a request whose next step is already
    launched. Nothing leaks, and every request that was not aborted gets its step-by-step tokens."""
    path = demo_model(arch="qwen2")
    rng = random.Random(seed)
    prompts = _prompts(24, seed=10 + seed)
    lengths = [rng.randrange(1, 30) for _ in prompts]
    kw = dict(use_tqdm=False, device=test_device, dtype="float32", max_model_len=128, max_num_seqs=8)
    ref = LLM(path, **kw)
    want = [
        o.outputs[0].token_ids
        for o in ref.generate(
            prompts, [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths]
        )
    ]
    ref.shutdown()

    llm = LLM(path, async_scheduling=True, num_kv_blocks=20, block_size=8, **kw)  # room for ~2 requests
    engine = llm.engine
    waiting = list(range(len(prompts)))
    ids: dict[str, int] = {}
    aborted: set[str] = set()
    got: dict[str, list[int]] = {}
    steps = 0
    while waiting or engine.has_pending_work():
        for _ in range(rng.choice([0, 0, 1, 3])):  # arrivals
            if waiting:
                i = waiting.pop(0)
                sp = SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
                ids[llm._add_request(prompts[i], sp, 0)] = i
        live = [r for r in ids if r not in got and r not in aborted]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            aborted.add(victim)
            llm._abort([victim])
        finished, to_stop = llm.output_processor.process_outputs(engine.step())
        assert not to_stop
        steps += 1
        for out in finished:
            got[out.request_id] = out.outputs[0].token_ids
        assert steps < 2000
    assert aborted and len(got) + len(aborted) == len(prompts)
    for rid, tokens in got.items():
        assert tokens == want[ids[rid]], rid
    assert llm.num_free_kv_blocks == engine.num_kv_blocks - 1
    assert engine.scheduler.num_preemptions > 0
    llm.shutdown()
