"""Scheduler tests, driven step by step with a fake model that plays the worker.

``FakeModel`` follows the scheduler's per-step diff (new requests, new blocks, finished and
preempted ids) like a real worker, "computes" KV by writing each token id into its block slot,
checks that every position a request attends to holds that request's token, and samples tokens
either from a per-request script or from a deterministic function of the context (a greedy model).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvfleet_engine.core.kv_cache_manager import KVCacheManager
from kvfleet_engine.core.messages import EngineCoreOutput, EngineCoreRequest
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.core.scheduler import Scheduler
from kvfleet_engine.input_processor import request_stop_token_ids
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.sampling_params import SamplingParams

BS = 4
EOS = 2
FILLER = 50  # scripted runs sample this unless told otherwise: never a stop token in these tests


def make_sched(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "fcfs",
    on_event=None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, on_event=on_event)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, policy)


def make_req(
    rid: str,
    prompt: list[int],
    max_tokens: int = 16,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    **params,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(
        EngineCoreRequest(
            rid,
            list(prompt),
            sp,
            max_tokens=max_tokens,
            stop_token_ids=request_stop_token_ids(sp, {EOS}),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
        ),
        block_size=BS,
    )


def prompt_of(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


@dataclass
class WorkerReq:
    tokens: list[int]
    block_ids: list[int]
    computed: int


class FakeModel:
    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None, sample_fn=None):
        self.sched = sched
        self.reqs: dict[str, WorkerReq] = {}
        self.kv: dict[int, list[int | None]] = defaultdict(lambda: [None] * BS)
        self.script = defaultdict(list, {k: list(v) for k, v in (script or {}).items()})
        self.sample_fn = sample_fn
        self.hash_tokens: dict[bytes, list[int]] = {}
        self.answered: set[str] = set()  # requests that had an output already

    def sample(self, rid: str, tokens: list[int]) -> int:
        if self.script[rid]:
            return self.script[rid].pop(0)
        if self.sample_fn is not None:
            return self.sample_fn(tokens)
        return FILLER

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, "a new request the worker already holds"
            self.reqs[nr.req_id] = WorkerReq(
                [*nr.prompt_token_ids, *nr.output_token_ids], list(nr.block_ids), nr.num_computed_tokens
            )
        for cr in so.scheduled_cached_reqs:
            w = self.reqs[cr.req_id]
            assert w.computed == cr.num_computed_tokens
            w.block_ids.extend(cr.new_block_ids)
        scheduled = {nr.req_id for nr in so.scheduled_new_reqs} | {c.req_id for c in so.scheduled_cached_reqs}
        assert set(so.num_scheduled_tokens) == scheduled
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        assert so.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert len(self.reqs) <= self.sched.max_num_seqs
        assert 0 not in {b for w in self.reqs.values() for b in w.block_ids}

        # One forward pass: every scheduled token's KV is written before any attention reads.
        for rid, n in so.num_scheduled_tokens.items():
            w = self.reqs[rid]
            assert w.computed + n <= len(w.tokens)
            assert w.computed + n <= self.sched.max_model_len
            assert len(w.block_ids) * BS >= w.computed + n
            for pos in range(w.computed, w.computed + n):
                self.kv[w.block_ids[pos // BS]][pos % BS] = w.tokens[pos]
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            w = self.reqs[rid]
            w.computed += n
            for pos in range(w.computed):
                assert self.kv[w.block_ids[pos // BS]][pos % BS] == w.tokens[pos], (
                    f"{rid} reads the wrong KV at position {pos}"
                )
            req_ids.append(rid)
            if w.computed == len(w.tokens):
                tok = self.sample(rid, w.tokens)
                w.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])  # partial prefill chunk
        return ModelRunnerOutput(req_ids, sampled)

    def remember_hashes(self) -> None:
        for req in self.sched.requests.values():
            for i, h in enumerate(req.block_hashes):
                self.hash_tokens[h] = req.all_token_ids[i * BS : (i + 1) * BS]

    def check_cache(self) -> None:
        """Every prefix-cache entry names a block that holds exactly its tokens."""
        for h, block in self.sched.kv.block_pool.cached_blocks.items():
            assert self.kv[block.block_id] == self.hash_tokens[h], f"cached {block} holds other KV"
        for rid, w in self.reqs.items():
            req = self.sched.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                assert w.tokens == req.all_token_ids

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        self.remember_hashes()
        so = self.sched.schedule()
        self.remember_hashes()
        outs = self.sched.update_from_output(so, self.execute(so))
        self.check_cache()
        self.check_output_order(outs)
        return so, outs

    def check_output_order(self, outs: list[EngineCoreOutput]) -> None:
        """A step lists first tokens, then finishing outputs, then the rest (a preempted request's later
        outputs are not first tokens)."""
        groups = [0 if o.request_id not in self.answered else 1 if o.finished else 2 for o in outs]
        assert groups == sorted(groups), [(o.request_id, g) for o, g in zip(outs, groups)]
        self.answered.update(o.request_id for o in outs)


def run_to_completion(model: FakeModel, max_steps: int = 500) -> dict[str, EngineCoreOutput]:
    finals: dict[str, EngineCoreOutput] = {}
    tokens: dict[str, list[int]] = defaultdict(list)
    for _ in range(max_steps):
        if not model.sched.has_unfinished_requests():
            break
        _, outs = model.step()
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    else:
        raise AssertionError("requests did not finish")
    for rid, o in finals.items():
        o.new_token_ids = tokens[rid]  # all of them, for convenience
    return finals


# ---- token budget --------------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    sched = make_sched(max_num_batched_tokens=32)
    model = FakeModel(sched)
    req = make_req("a", prompt_of(100), max_tokens=3)
    sched.add_request(req)
    chunks = []
    for _ in range(3):
        so, outs = model.step()
        chunks.append(so.num_scheduled_tokens["a"])
        assert outs == []  # a partial prefill samples nothing
        assert req.num_output_tokens == 0
    so, outs = model.step()
    chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [32, 32, 32, 4]
    assert [o.new_token_ids for o in outs] == [[FILLER]]
    assert req.num_computed_tokens == 100 and req.num_tokens == 101
    # Then one token per step.
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_new_reqs == [] and [c.req_id for c in so.scheduled_cached_reqs] == ["a"]


def test_decodes_go_first_and_prefill_gets_the_rest_of_the_budget():
    sched = make_sched(max_num_batched_tokens=32)
    model = FakeModel(sched)
    sched.add_request(make_req("a", prompt_of(10), max_tokens=50))
    sched.add_request(make_req("b", prompt_of(5, 300), max_tokens=50))
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"a": 10, "b": 5}

    sched.add_request(make_req("c", prompt_of(100, 500), max_tokens=50))
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 30}
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a", "b"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["c"]
    assert so.total_num_scheduled_tokens == 32

    # The running prefill continues behind the decodes, in admission order.
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 30}
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a", "b", "c"]
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 30}
    so, outs = model.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 10}
    assert {o.request_id for o in outs} == {"a", "b", "c"}


def test_budget_stops_waiting_admissions_and_chunks_the_last_one():
    sched = make_sched(max_num_batched_tokens=16)
    model = FakeModel(sched)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", prompt_of(7, 100 * (i + 1))))
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"r0": 7, "r1": 7, "r2": 2}
    assert sched.get_num_unfinished_requests() == 3 and len(sched.waiting) == 0


def test_max_num_seqs_limits_running_requests():
    sched = make_sched(max_num_seqs=2)
    model = FakeModel(sched)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", prompt_of(5, 100 * (i + 1)), max_tokens=2))
    so, _ = model.step()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    so, outs = model.step()  # r0 and r1 finish (2 tokens each)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert all(o.finished for o in outs)
    so, _ = model.step()
    assert set(so.num_scheduled_tokens) == {"r2", "r3"}
    assert so.finished_req_ids == {"r0", "r1"}


# ---- preemption ----------------------------------------------------------------------------------


def test_fcfs_preempts_the_last_admitted_and_resumes_it_first():
    sched = make_sched(num_blocks=5)  # 4 usable blocks
    model = FakeModel(sched)
    a = make_req("a", prompt_of(7, 100), max_tokens=5)
    b = make_req("b", prompt_of(7, 200), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    model.step()  # both prefilled: 2 blocks each, 8 tokens each
    model.step()  # one decode each, still 2 blocks each
    assert sched.kv.get_num_free_blocks() == 0
    b_outputs = list(b.output_token_ids)
    assert len(b_outputs) == 2

    c = make_req("c", prompt_of(3, 300), max_tokens=2)
    sched.add_request(c)
    so, _ = model.step()  # a needs a 3rd block: b (last admitted) is preempted
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}  # no admissions in a step that preempted
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert "b" not in sched.kv.req_to_blocks
    assert list(sched.waiting) == [b, c]  # back at the front, ahead of c
    assert b.output_token_ids == b_outputs  # kept: they are recomputed, not re-sampled
    assert sched.stats().num_preemptions == 1

    # a finishes (5 tokens) and frees its blocks; b comes back first with its outputs replayed.
    resumed = None
    for _ in range(5):
        so, _ = model.step()
        for nr in so.scheduled_new_reqs:
            if nr.req_id == "b":
                resumed = nr
        if resumed:
            break
    assert resumed is not None
    assert [nr.req_id for nr in so.scheduled_new_reqs] == ["b", "c"]  # b first, then c behind it
    assert resumed.output_token_ids == b_outputs
    assert resumed.prompt_token_ids == b.prompt_token_ids
    # Its block 0 survived in the prefix cache (block 1 was reused by a), so it restarts at 4.
    assert resumed.num_computed_tokens == BS
    assert so.num_scheduled_tokens["b"] == 7 + 2 - BS
    assert b.num_cached_tokens == 0  # the hit stat is from its first admission only

    finals = run_to_completion(model)
    assert finals["b"].finish_reason == "length" and b.num_output_tokens == 5
    assert sched.kv.get_num_free_blocks() == 4


def test_priority_preempts_lowest_priority_and_undoes_its_schedule():
    sched = make_sched(num_blocks=4, policy="priority")  # 3 usable blocks
    model = FakeModel(sched)
    low = make_req("low", prompt_of(6, 100), max_tokens=6, priority=9, arrival_time=0)
    sched.add_request(low)
    model.step()  # low: 2 blocks, 7 tokens
    high = make_req("high", prompt_of(4, 200), max_tokens=3, priority=0, arrival_time=1)
    sched.add_request(high)
    so, _ = model.step()  # low decodes (8 tokens); high admitted into the last block (5 tokens)
    assert so.num_scheduled_tokens == {"low": 1, "high": 4}
    assert sched.kv.get_num_free_blocks() == 0

    # high needs a 2nd block; low, scheduled first in this step but lowest priority, is preempted and
    # its schedule withdrawn (budget, block list and output).
    so, _ = model.step()
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"high": 1}
    assert so.total_num_scheduled_tokens == 1
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["high"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [r.request_id for r in sched.running] == ["high"]

    finals = run_to_completion(model)
    assert finals["high"].finish_reason == "length"
    assert finals["low"].finish_reason == "length" and low.num_output_tokens == 6
    assert sched.kv.get_num_free_blocks() == 3


def test_priority_preempts_the_lowest_even_when_admitted_later():
    sched = make_sched(num_blocks=5, policy="priority")  # 4 usable blocks
    model = FakeModel(sched)
    a = make_req("a", prompt_of(7, 100), max_tokens=4, priority=1, arrival_time=0)
    b = make_req("b", prompt_of(7, 200), max_tokens=4, priority=5, arrival_time=1)
    sched.add_request(a)
    sched.add_request(b)
    model.step()
    model.step()
    so, _ = model.step()  # a needs a 3rd block; b is the lowest priority
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    run_to_completion(model)
    assert a.num_output_tokens == b.num_output_tokens == 4


def test_priority_preempts_itself_when_it_is_the_lowest():
    sched = make_sched(num_blocks=5, policy="priority")  # 4 usable blocks
    model = FakeModel(sched)
    low = make_req("low", prompt_of(7, 100), max_tokens=4, priority=5, arrival_time=0)
    sched.add_request(low)
    model.step()  # low: 2 blocks, 8 tokens
    high = make_req("high", prompt_of(6, 200), max_tokens=4, priority=1, arrival_time=1)
    sched.add_request(high)
    model.step()  # high: 2 blocks; every block is taken
    so, _ = model.step()  # low (first in the running list) needs a 3rd block and is its own victim
    assert so.preempted_req_ids == {"low"}
    # Nothing after the preempted request is scheduled in this step (as in vLLM).
    assert so.num_scheduled_tokens == {} and so.is_empty
    so, _ = model.step()
    assert so.num_scheduled_tokens == {"high": 1}
    run_to_completion(model)
    assert low.num_output_tokens == high.num_output_tokens == 4


def test_priority_admits_waiting_requests_by_priority_then_arrival():
    sched = make_sched(max_num_seqs=1, policy="priority")
    model = FakeModel(sched)
    for rid, prio, t in [("p5", 5, 0), ("p1", 1, 1), ("p3", 3, 2), ("p1b", 1, 3)]:
        sched.add_request(
            make_req(rid, prompt_of(3, 100 * (t + 1)), max_tokens=1, priority=prio, arrival_time=t)
        )
    order = []
    while sched.has_unfinished_requests():
        so, _ = model.step()
        order += [nr.req_id for nr in so.scheduled_new_reqs]
    assert order == ["p1", "p1b", "p3", "p5"]


def test_fcfs_admits_in_arrival_order_regardless_of_priority():
    sched = make_sched(max_num_seqs=1)
    model = FakeModel(sched)
    for rid, prio in [("p5", 5), ("p1", 1), ("p3", 3)]:
        sched.add_request(make_req(rid, prompt_of(3), max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished_requests():
        so, _ = model.step()
        order += [nr.req_id for nr in so.scheduled_new_reqs]
    assert order == ["p5", "p1", "p3"]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        make_sched(policy="lifo")


def test_priority_preemption_does_not_cache_blocks_that_never_ran():
    """Regression: low was scheduled (its block 0 registered in the prefix cache) and then preempted
    in the same step, so its last token's KV was never written. That block must not stay cached:
    a later request sharing the prefix would reuse KV that was never computed."""
    sched = make_sched(num_blocks=9, max_num_batched_tokens=16, max_model_len=32, policy="priority")
    model = FakeModel(sched)
    x = make_req("x", prompt_of(7, 100), max_tokens=30, priority=0, arrival_time=0)
    low = make_req("low", [1, 3], max_tokens=30, priority=9, arrival_time=1)
    sched.add_request(x)
    sched.add_request(low)
    model.script["low"] = [4, 5]
    model.step()  # x: 2 blocks; low: 1 block, 3 tokens
    high = make_req("high", prompt_of(22, 200), max_tokens=30, priority=0, arrival_time=2)
    sched.add_request(high)
    model.step()  # x, low decode; high prefills 14 tokens into 4 blocks
    assert sched.kv.get_num_free_blocks() == 1
    # low's decode fills its block 0 (registered), x takes the last free block, high cannot grow:
    # low, then high itself are preempted. low's token at position 3 never ran.
    so, _ = model.step()  # model.step() checks that every cached block holds its tokens
    assert so.preempted_req_ids == {"low", "high"}
    assert low.block_hashes[0] not in sched.kv.block_pool.cached_blocks

    # A request sharing low's whole first block gets no hit on it and computes it.
    probe = make_req("probe", [1, 3, 4, 5, 9], max_tokens=1, priority=0, arrival_time=3)
    sched.add_request(probe)
    finals = run_to_completion(model)
    assert finals["probe"].num_cached_tokens == 0
    assert sched.kv.get_num_free_blocks() == 8


# ---- stop conditions -----------------------------------------------------------------------------


def run_one(req: Request, script: list[int], **sched_kwargs) -> EngineCoreOutput:
    sched = make_sched(**sched_kwargs)
    model = FakeModel(sched, script={req.request_id: script})
    sched.add_request(req)
    return run_to_completion(model)[req.request_id]


def test_eos_stops_without_stop_reason():
    out = run_one(make_req("a", prompt_of(5), max_tokens=10), [7, 8, EOS, 9])
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.new_token_ids == [7, 8, EOS]


def test_ignore_eos_runs_to_max_tokens():
    req = make_req("a", prompt_of(5), max_tokens=4, ignore_eos=True)
    out = run_one(req, [EOS, EOS, 7, EOS, 9])
    assert out.finish_reason == "length"
    assert out.new_token_ids == [EOS, EOS, 7, EOS]


def test_stop_token_id_is_reported_as_stop_reason():
    req = make_req("a", prompt_of(5), max_tokens=10, stop_token_ids=[77])
    out = run_one(req, [7, 77, 8])
    assert out.finish_reason == "stop" and out.stop_reason == 77
    assert out.new_token_ids == [7, 77]


def test_min_tokens_suppresses_stopping():
    req = make_req("a", prompt_of(5), max_tokens=10, min_tokens=3, stop_token_ids=[77])
    out = run_one(req, [EOS, 77, EOS, 8])
    assert out.finish_reason == "stop" and out.stop_reason is None  # the 3rd token (EOS) may stop
    assert out.new_token_ids == [EOS, 77, EOS]

    req = make_req("b", prompt_of(5), max_tokens=10, min_tokens=2, stop_token_ids=[77])
    out = run_one(req, [77, 77])
    assert out.finish_reason == "stop" and out.stop_reason == 77
    assert out.new_token_ids == [77, 77]


def test_max_tokens_finishes_with_length():
    out = run_one(make_req("a", prompt_of(5), max_tokens=3), [])
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.new_token_ids == [FILLER] * 3


def test_max_model_len_finishes_with_length():
    req = make_req("a", prompt_of(10), max_tokens=100)
    out = run_one(req, [], max_model_len=13)
    assert out.finish_reason == "length"
    assert req.num_tokens == 13 and out.new_token_ids == [FILLER] * 3


def test_max_model_len_caps_a_prompt_filling_it():
    req = make_req("a", prompt_of(12), max_tokens=100)
    out = run_one(req, [], max_model_len=12)
    assert out.finish_reason == "length" and out.new_token_ids == [FILLER]


# ---- aborts and bookkeeping ----------------------------------------------------------------------


def test_finish_requests_frees_waiting_and_running_requests():
    sched = make_sched(num_blocks=16, max_num_seqs=2)
    model = FakeModel(sched)
    initial = sched.kv.get_num_free_blocks()
    for i in range(3):
        sched.add_request(make_req(f"r{i}", prompt_of(9, 100 * (i + 1)), max_tokens=50))
    model.step()
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert "r0" in sched.kv.req_to_blocks

    aborted = sched.finish_requests(["r0", "r2", "nope"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in aborted} == {"r0", "r2"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert "r0" not in sched.kv.req_to_blocks
    assert [r.request_id for r in sched.running] == ["r1"] and len(sched.waiting) == 0
    assert sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED) == []  # already gone

    so, _ = model.step()
    assert so.finished_req_ids == {"r0", "r2"}
    assert set(so.num_scheduled_tokens) == {"r1"}
    so, _ = model.step()
    assert so.finished_req_ids == set()  # reported once

    sched.finish_requests(["r1"], RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished_requests()
    so, _ = model.step()
    assert so.finished_req_ids == {"r1"} and so.is_empty
    assert sched.kv.get_num_free_blocks() == initial
    assert sched.requests == {}


def test_duplicate_request_id_is_rejected():
    sched = make_sched()
    sched.add_request(make_req("a", prompt_of(3)))
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", prompt_of(3)))


def test_stopped_requests_are_reported_to_the_worker_next_step():
    sched = make_sched()
    model = FakeModel(sched, script={"a": [EOS]})
    sched.add_request(make_req("a", prompt_of(5)))
    sched.add_request(make_req("b", prompt_of(5, 300)))
    _, outs = model.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "stop"), ("b", None)]
    so, _ = model.step()
    assert so.finished_req_ids == {"a"}
    assert "a" not in model.reqs


def test_a_step_lists_first_tokens_then_finishing_requests_then_the_rest():
    """The order a step's outputs are written to their streams: a new request's first token must not wait
    behind every running stream's token (in batch order it came last)."""
    sched = make_sched()
    model = FakeModel(sched)
    sched.add_request(make_req("old", prompt_of(5), max_tokens=10))
    sched.add_request(make_req("ending", prompt_of(5, 300), max_tokens=3))
    for _ in range(2):
        model.step()
    sched.add_request(make_req("new", prompt_of(5, 500), max_tokens=10))
    so, outs = model.step()
    assert list(so.num_scheduled_tokens) == ["old", "ending", "new"]  # the batch order
    assert [(o.request_id, o.finish_reason) for o in outs] == [
        ("new", None),
        ("ending", "length"),
        ("old", None),
    ]


def test_stats():
    sched = make_sched(num_blocks=9)
    model = FakeModel(sched)
    sched.add_request(make_req("a", prompt_of(8), max_tokens=3))
    sched.add_request(make_req("b", prompt_of(8, 300), max_tokens=3))
    model.step()
    st_ = sched.stats()
    assert (st_.num_running, st_.num_waiting, st_.num_preemptions) == (2, 0, 0)
    assert st_.kv_cache_usage == pytest.approx(4 / 8)
    run_to_completion(model)
    assert sched.stats().kv_cache_usage == 0.0


# ---- prefix caching across requests --------------------------------------------------------------


def test_prefix_hit_across_steps():
    sched = make_sched()
    model = FakeModel(sched)
    shared = prompt_of(2 * BS, 100)
    a = make_req("a", [*shared, 1, 3, 5], max_tokens=2)
    sched.add_request(a)
    run_to_completion(model)
    assert a.num_cached_tokens == 0

    b = make_req("b", [*shared, 7, 7], max_tokens=2)
    sched.add_request(b)
    so, outs = model.step()
    (nr,) = so.scheduled_new_reqs
    assert nr.num_computed_tokens == 2 * BS
    assert so.num_scheduled_tokens == {"b": 2}
    assert b.num_cached_tokens == 2 * BS
    assert outs[0].num_cached_tokens == 2 * BS
    run_to_completion(model)

    # A prompt equal to the cached prefix: the last token must run, so only 1 block is a hit.
    c = make_req("c", shared, max_tokens=1)
    sched.add_request(c)
    finals = run_to_completion(model)
    assert finals["c"].num_cached_tokens == BS
    stats = sched.kv.stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 11 + 10 + 8, 2 * BS + BS)


def test_prefix_hit_within_one_step():
    """The second of two identical prompts admitted in the same step shares the first one's blocks."""
    sched = make_sched()
    model = FakeModel(sched)
    prompt = prompt_of(3 * BS, 100)
    sched.add_request(make_req("a", prompt, max_tokens=2))
    sched.add_request(make_req("b", prompt, max_tokens=2))
    so, _ = model.step()
    assert [nr.num_computed_tokens for nr in so.scheduled_new_reqs] == [0, 2 * BS]
    assert so.num_scheduled_tokens == {"a": 3 * BS, "b": BS}
    run_to_completion(model)


# ---- randomized workloads ------------------------------------------------------------------------


class EventReplay:
    """A KV-event consumer: the set of cached hashes rebuilt from the stream."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def __call__(self, events) -> None:
        for kind, h in events:
            if kind == "stored":
                self.hashes.add(h)
            elif kind == "removed":
                self.hashes.remove(h)
            else:
                self.hashes.clear()


def greedy(tokens: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole context."""
    h = 0
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 10 + h % 7 if h % 23 else EOS


def reference_output(req: Request, max_model_len: int) -> tuple[list[int], str]:
    tokens = list(req.prompt_token_ids)
    out: list[int] = []
    while True:
        t = greedy(tokens)
        tokens.append(t)
        out.append(t)
        # Length is checked first (as in vLLM): EOS as the last allowed token reports "length".
        if len(out) >= req.max_tokens or len(tokens) >= max_model_len:
            return out, "length"
        if t == EOS and not req.sampling_params.ignore_eos:
            return out, "stop"


STEMS = [[10, 11, 12, 13, 14, 15, 16, 10, 11, 12, 13, 14], [10, 11, 12, 13, 16, 16, 16, 16], [15, 14, 13, 12]]

request_spec = st.fixed_dictionaries(
    {
        "stem": st.integers(0, len(STEMS) - 1),
        "stem_len": st.integers(0, 12),
        "suffix": st.lists(st.integers(10, 16), max_size=6),
        "max_tokens": st.integers(1, 16),
        "priority": st.integers(0, 3),
        "arrival_step": st.integers(0, 4),
        "ignore_eos": st.booleans(),
        "abort_after": st.one_of(st.none(), st.integers(0, 10)),
    }
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(request_spec, min_size=1, max_size=8),
    num_blocks=st.integers(5, 12),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 4),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_workloads_match_a_run_without_interference(specs, num_blocks, budget, max_num_seqs, policy):
    """Whatever chunking, preemption and prefix sharing happen, every request that was not aborted
    produces exactly what the greedy model produces for it alone, and everything is freed at the end."""
    sink = EventReplay()
    max_model_len = (num_blocks - 1) * BS  # a lone request always fits
    sched = make_sched(
        num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        policy=policy,
        on_event=sink,
    )
    model = FakeModel(sched, sample_fn=greedy)
    initial = sched.kv.get_num_free_blocks()
    reqs: dict[str, Request] = {}
    pending = sorted(enumerate(specs), key=lambda x: x[1]["arrival_step"])
    aborts: dict[int, list[str]] = defaultdict(list)
    tokens: dict[str, list[int]] = defaultdict(list)
    finals: dict[str, EngineCoreOutput] = {}

    for step in range(1000):
        while pending and pending[0][1]["arrival_step"] <= step:
            i, spec = pending.pop(0)
            prompt = (STEMS[spec["stem"]][: spec["stem_len"]] + spec["suffix"]) or [10]
            prompt = prompt[: max_model_len - 1]
            req = make_req(
                f"r{i}",
                prompt,
                spec["max_tokens"],
                priority=spec["priority"],
                arrival_time=float(i),
                ignore_eos=spec["ignore_eos"],
            )
            reqs[req.request_id] = req
            sched.add_request(req)
            if spec["abort_after"] is not None:
                aborts[step + spec["abort_after"]].append(req.request_id)
        sched.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)
        if not pending and not sched.has_unfinished_requests():
            break
        _, outs = model.step()
        assert sink.hashes == set(sched.kv.block_pool.cached_blocks)
        assert len(sched.running) <= max_num_seqs
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    else:
        raise AssertionError("the workload did not finish")

    for rid, req in reqs.items():
        expected, reason = reference_output(req, max_model_len)
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert rid not in finals
            assert tokens[rid] == expected[: len(tokens[rid])]
        else:
            assert tokens[rid] == expected
            assert req.output_token_ids == expected
            assert finals[rid].finish_reason == reason
    assert sched.kv.get_num_free_blocks() == initial
    assert sched.kv.req_to_blocks == {} and sched.requests == {}
    event(f"preemptions: {min(sched.num_preemptions, 3)}+")
    event(f"prefix hits: {sched.kv.stats.hits > 0}")
