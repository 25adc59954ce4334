"""Structured outputs under scheduling pressure: chunked prefill and preemption.

One engine with a 32-token step budget (a ~230-token prompt is prefilled over eight steps) and a KV
cache of 80 blocks of 16 tokens, far too small for the batch: requests are preempted and
recomputed while their grammars are part-way through. A recompute replays the accepted tokens as prompt,
so a grammar must neither re-consume them nor lose them: every response still conforms, and greedy
responses are the same tokens as the same request run alone.
"""

from __future__ import annotations

import pytest

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.structured_output.params import StructuredOutputsParams
from tests.engine.structured_schemas import MAX_TOKENS, SCHEMAS, corpus_failures

STEP_TOKEN_BUDGET = 32
KV_BLOCKS = 80
MAX_MODEL_LEN = (KV_BLOCKS - 1) * 16  # the engine keeps one block back

# A long document to extract from: the prompt needs many prefill chunks before the first constrained token.
DOCUMENT = (
    "Quarterly report. The northern warehouse shipped 1,204 orders in March, up from 980 in February; "
    "returns fell to 2.1 percent. Two suppliers were late: Acme Parts by nine days and Borealis by four. "
    "The support queue closed 311 tickets, 14 of them escalated, median time to close 6.5 hours. "
) * 2


def _prompt(i: int, name: str) -> str:
    return f"Document {i}: {DOCUMENT}\nExtract a {name} record as JSON.\n"


@pytest.fixture(scope="module")
def llm(demo_model, test_device):
    engine = LLM(
        demo_model(arch="llama"),
        device=test_device,
        dtype="float32",
        use_tqdm=False,
        max_num_batched_tokens=STEP_TOKEN_BUDGET,
        num_kv_blocks=KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )
    yield engine
    engine.shutdown()


def _params(name: str, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True),
        **kw,
    )


def test_prompt_is_chunked(llm):
    prompt_tokens = len(llm.get_tokenizer().encode(_prompt(0, "person")))
    assert prompt_tokens > 5 * STEP_TOKEN_BUDGET
    assert prompt_tokens + MAX_TOKENS <= MAX_MODEL_LEN


def test_corpus_conforms_through_chunked_prefill_and_preemption(llm):
    names = list(SCHEMAS)  # the cache holds about five of these sequences at once
    prompts = [_prompt(i, name) for i, name in enumerate(names)]
    # Greedy and seeded sampling (n=2) in one batch: more sequences than the cache holds.
    params = [
        _params(name, temperature=0) if i % 2 == 0 else _params(name, n=2, temperature=1.0, seed=i)
        for i, name in enumerate(names)
    ]
    preemptions_before = llm.engine.scheduler.num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > preemptions_before, (
        "the small KV cache forced no preemption"
    )
    failures = corpus_failures(outputs, names)
    assert not failures, "\n".join(failures)

    # Greedy responses that went through preemption are the tokens of the same request run alone.
    greedy = list(range(0, len(names), 2))
    alone = [llm.generate(prompts[i], params[i], use_tqdm=False)[0] for i in greedy]
    assert [a.outputs[0].token_ids for a in alone] == [outputs[i].outputs[0].token_ids for i in greedy]
    assert not llm.engine.has_unfinished_requests()
    pool = llm.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
