"""StepRates: the measured prefill/decode throughput that heartbeats carry to the gateway's router."""

from types import SimpleNamespace

import pytest

from kvfleet_engine.core.engine_core import StepRates
from kvfleet_engine.core.sched_output import SchedulerOutput


def step(tokens: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput([], [], tokens, sum(tokens.values()))


REQUESTS = {
    "prefill-a": SimpleNamespace(num_output_tokens=0),
    "prefill-b": SimpleNamespace(num_output_tokens=0),
    "decode-1": SimpleNamespace(num_output_tokens=3),
    "decode-2": SimpleNamespace(num_output_tokens=9),
    "last-prompt-token": SimpleNamespace(num_output_tokens=0),  # a 1-token prefill chunk is not a decode
}


def test_pure_steps_measure_their_own_rates():
    rates = StepRates()
    rates.record(step({"prefill-a": 300, "prefill-b": 100}), REQUESTS, 0.5)
    assert rates.prefill_tokens_per_s == pytest.approx(800)
    assert rates.decode_tokens_per_s == 0.0
    rates.record(step({"decode-1": 1, "decode-2": 1}), REQUESTS, 0.01)
    assert rates.decode_tokens_per_s == pytest.approx(200)
    assert rates.prefill_tokens_per_s == pytest.approx(800)  # a decode-only step says nothing of prefill


def test_mixed_steps_split_time_by_tokens_and_average():
    rates = StepRates(alpha=0.5)
    rates.record(step({"prefill-a": 98, "decode-1": 1, "decode-2": 1}), REQUESTS, 0.1)
    assert rates.prefill_tokens_per_s == pytest.approx(1000)  # 100 tokens in 0.1 s
    assert rates.decode_tokens_per_s == pytest.approx(20)  # 2 decodes in 0.1 s
    rates.record(step({"prefill-a": 200}), REQUESTS, 0.1)
    assert rates.prefill_tokens_per_s == pytest.approx(1500)  # EMA of 1000 and 2000
    rates.record(step({"last-prompt-token": 1}), REQUESTS, 0.001)
    assert rates.decode_tokens_per_s == pytest.approx(20)
    rates.record(step({}), REQUESTS, 0.1)  # empty steps change nothing
    assert rates.prefill_tokens_per_s == pytest.approx(1250)
