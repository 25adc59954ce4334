"""The engine core's side of structured outputs: compile queue, bitmasks, matcher bookkeeping, failures.

The corpus of schemas and the pressure cases (preemption, chunked prefill, n>1) are in
test_structured_outputs*.py; tensor and pipeline parallelism in test_parallel.py. Here: the pieces
those rest on, each checked against an independent computation.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.core.engine_core import EngineCore
from kvfleet_engine.core.messages import EngineCoreRequest
from kvfleet_engine.request import RequestStatus
from kvfleet_engine.structured_output import backend
from kvfleet_engine.structured_output.bitmask import apply_token_bitmask
from kvfleet_engine.structured_output.params import StructuredOutputsParams

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, use_tqdm=False)


def _reference_mask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """Bit by bit, in Python: what apply_token_bitmask must produce."""
    out = logits.clone()
    for i, row in enumerate(rows):
        for t in range(out.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[i, word]) >> (t % 32)) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 70, 100])  # equal to, narrower than and wider than 32 x words
@pytest.mark.parametrize("rows", [[3, 1], [0, 1, 2, 3]])  # some rows (gathered), every row in order
def test_bitmask_masks_exactly_the_cleared_bits_of_the_chosen_rows(vocab, rows, test_device):
    rng = np.random.default_rng(vocab)
    words = 3 if vocab != 64 else 2
    bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab))
    expected = _reference_mask(logits, bitmask, rows)
    got = logits.to(test_device)
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got.cpu(), expected)
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(got.cpu()[untouched], logits[untouched])  # rows without a grammar


def test_params_canonicalise_schemas_and_refuse_ambiguity():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{ "properties": {"a": {}, "b": {}},\n "type": "object"}')
    assert a.cache_key == b.cache_key
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


@pytest.mark.parametrize(
    "params, fragment",
    [
        (StructuredOutputsParams(regex="[a-"), "regex does not compile"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar does not compile"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "JSON schema does not compile"),
    ],
)
def test_validate_names_what_does_not_compile(params, fragment):
    with pytest.raises(backend.GrammarError, match=fragment):
        backend.validate(params)


@pytest.fixture(scope="module")
def llm(demo_model, test_device):
    engine = LLM(demo_model(arch="llama"), device=test_device, **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _core_request(rid: str, params: SamplingParams, prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, params, params.max_tokens, frozenset({0}), time.monotonic())


def _run(core: EngineCore, max_steps: int = 500) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_pending_work():
            break
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not core.has_pending_work()
    return outputs


def test_a_grammar_that_fails_in_the_core_ends_its_request_and_nothing_else(llm):
    """The API server validates grammars (a 400 there); one that still fails in the core (here: added
    past the InputProcessor) ends its own request with the reason, frees everything, and the engine
    serves the request beside it."""
    core = llm.engine
    free_before = core.scheduler.kv.get_num_free_blocks()
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-"))
    good = SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}")
    )
    core.add_request(_core_request("bad", bad, [5, 6, 7]))
    core.add_request(_core_request("good", good, [5, 6, 7]))
    outputs = _run(core)
    (failed,) = outputs["bad"]
    assert failed.finish_reason == "abort" and "does not compile" in failed.stop_reason
    assert outputs["good"][-1].finish_reason == "stop" and outputs["good"][-1].grammar_complete
    assert sum(len(o.new_token_ids) for o in outputs["good"]) >= 1
    assert core.scheduler.kv.get_num_free_blocks() == free_before
    assert core.scheduler.num_constrained == 0


def test_aborting_a_request_while_its_grammar_compiles_leaves_nothing_behind(llm):
    core = llm.engine
    # A schema no request used before: it is compiled now, on the manager's thread.
    params = SamplingParams(
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(json={"type": "object", "title": f"t{time.time_ns()}"}),
    )
    core.add_request(_core_request("abort-me", params, [9, 9, 9]))
    req = core.scheduler.requests["abort-me"]
    assert req.status == RequestStatus.WAITING_FOR_GRAMMAR
    core.abort_requests(["abort-me"])
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert core.scheduler.waiting_for_grammar == [] and core.scheduler.num_constrained == 0
    assert not core.has_unfinished_requests()
    _run(core)


def test_every_sampled_token_is_one_the_grammar_allowed(llm, demo_model):
    """Sampled at temperature 1 with the top-5 logprobs: no token outside the grammar is ever chosen,
    and every masked-out token has logprob -inf (the logprobs are of the constrained distribution)."""
    choices = ["alpha", "beta", "gamma delta"]
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=16, logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )  # fmt: skip
    (out,) = llm.generate(["pick one"], params)
    for completion in out.outputs:
        assert completion.text in choices
        assert completion.finish_reason == "stop"
        for step in completion.logprobs:
            finite = [t for t, lp in step.items() if lp.logprob != float("-inf")]
            assert finite, step
    assert not llm.engine.has_unfinished_requests()


def test_one_schema_compiles_once_for_many_requests(llm):
    manager = llm.engine.structured_outputs
    schema = {
        "type": "object",
        "properties": {"k": {"type": "boolean"}},
        "required": ["k"],
        "additionalProperties": False,
        "title": "once",
    }
    before = manager.num_compiles
    params = SamplingParams(
        n=3, max_tokens=40, temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )  # fmt: skip
    outs = llm.generate(["a", "b", "c"], params)
    assert manager.num_compiles == before + 1
    texts = {c.text for o in outs for c in o.outputs}
    assert texts <= {'{"k":true}', '{"k":false}'}
