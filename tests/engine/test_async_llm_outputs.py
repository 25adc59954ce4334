"""AsyncLLM's output path: a step's outputs reach their handlers slice by slice, first slice first.

The test plays the engine core on the ZMQ sockets the real client binds (a PULL socket takes the
requests), and hands the frontend one step's outputs the way the client's output loop does.
"""

from __future__ import annotations

import asyncio

import zmq

from kvfleet_engine.async_llm import OUTPUT_SLICE, AsyncLLM
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.messages import REQUESTS_DECODER, EngineCoreOutput, EngineCoreOutputs, RequestKind
from kvfleet_engine.engine_args import EngineArgs
from kvfleet_engine.sampling_params import SamplingParams


def test_a_steps_outputs_reach_their_handlers_slice_by_slice(demo_model):
    config = EngineConfig.create(EngineArgs(demo_model(), max_model_len=256))
    asyncio.run(_slices(config))


async def _slices(config: EngineConfig) -> None:
    llm = AsyncLLM(config)
    n = 2 * OUTPUT_SLICE + 5
    core_input = llm.client._ctx.socket(zmq.PULL)
    core_input.connect(llm.client._input_addr)
    # How many of the step's outputs the frontend had processed when each handler got its delta.
    processed_when_seen: dict[str, int] = {}
    texts: dict[str, str] = {}

    def processed() -> int:
        return sum(
            len(seq.token_ids) for req in llm.output_processor.requests.values() for seq in req.seqs.values()
        )

    async def handler(rid: str) -> None:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        async for out in llm.generate([1, 2, 3], params, request_id=rid):
            processed_when_seen.setdefault(rid, processed())
            texts[rid] = texts.get(rid, "") + out.outputs[0].text

    rids = [f"r{i}" for i in range(n)]
    handlers = [asyncio.create_task(handler(rid)) for rid in rids]
    try:
        received = []
        while len(received) < n:
            kind, payload = await asyncio.wait_for(core_input.recv_multipart(), 10)
            assert kind == RequestKind.ADD.value
            received += [r.request_id for r in REQUESTS_DECODER.decode(payload)]
        assert sorted(received) == sorted(rids)

        token = llm.tokenizer.encode(" hello", add_special_tokens=False)[0]
        step = [EngineCoreOutput(rid, [token]) for rid in rids]
        await llm._on_outputs(EngineCoreOutputs(outputs=step))
        await asyncio.sleep(0)  # the last slice's handlers

        # Every handler ran once its own slice was done, before the next one was detokenized.
        for i, rid in enumerate(rids):
            own_slice_end = min((i // OUTPUT_SLICE + 1) * OUTPUT_SLICE, n)
            assert processed_when_seen[rid] == own_slice_end, (rid, processed_when_seen[rid])

        last = [EngineCoreOutput(rid, [token], finish_reason="length") for rid in rids]
        await llm._on_outputs(EngineCoreOutputs(outputs=last))
        await asyncio.wait_for(asyncio.gather(*handlers), 10)
        assert all(texts[rid] == llm.tokenizer.decode([token, token]) for rid in rids)
        assert not llm.output_processor.requests and llm.num_unfinished_requests == 0
    finally:
        for t in handlers:
            t.cancel()
        core_input.close(linger=0)
        llm.shutdown()
