"""Schemathesis against the gateway's ``/v1`` (its own OpenAPI schema), with a tenant's key: no 5xx.

Both of schemathesis' modes: requests that follow the schema (they reach the replicas) and requests that
break it on purpose (wrong types, out-of-range integers, missing fields). Such a run found a 500 once
(an ``OverflowError`` hashing a token id past int32). Bounded: 100 examples an operation a mode (seconds).
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.test_bad_input import _keep_generation_short

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 100


@pytest.fixture(scope="module")
def key(fleet):
    return fleet.gateway.create_tenant("fuzzer")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_errors_under_v1(fleet, key, mode):
    g = fleet.gateway
    schema = schemathesis.openapi.from_url(f"{g.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if op.path.startswith("/v1/")]
    assert {op.path for op in operations} >= {"/v1/models", "/v1/completions", "/v1/chat/completions"}
    failures: list = []
    statuses: set[int] = set()
    for op in operations:
        if mode == "negative" and op.method.upper() == "GET":
            continue  # GET /v1/models takes nothing that could be wrong
        _fuzz(op, mode, g.url, key, statuses, failures)
    assert not failures, failures[:3]
    expected = {400} if mode == "negative" else {200, 400}  # valid by the schema, some still too long
    assert statuses & expected == expected, statuses
    assert httpx.get(f"{g.url}/health", timeout=10).status_code == 200
    assert "Traceback" not in g.log()


def _fuzz(op, mode: str, base_url: str, key: str, statuses: set[int], failures: list) -> None:
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
    def fuzz(case):
        _keep_generation_short(case.body)
        response = case.call(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})
        statuses.add(response.status_code)
        if response.status_code >= 500:
            failures.append(
                (op.method, op.path, repr(case.body)[:300], response.status_code, response.text[:300])
            )

    fuzz()
