"""``bench/clients.py``: the benchmark clients users run keep working against kvfleet (issue 27).

One stack for the module: a real Redis, a ``kvfleet engine serve`` replica of the tiny demo model (the real
engine on CPU) and a ``kvfleet gateway`` with a tenant key. The openai SDK (in the dev environment) runs as a
normal test through the bench's own code path, against the gateway and the replica. aiperf, guidellm and
inference-perf run only when their virtual environments are given (``KVFLEET_CLIENT_VENVS`` or on PATH, see
docs/BENCHMARKS.md) and are marked slow; CI, which has none of them, skips them with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("transformers")

from bench import _clients_runners as runners
from bench import clients
from bench._clients_stack import ClientStack, parse_engine_counters

# The fast test: one request of each of the SDK's four shapes. The external clients: a few more.
FAST = runners.Workload(requests=4, concurrency=2, prompt_tokens=32, output_tokens=8)
SMALL = runners.Workload(requests=8, concurrency=2, prompt_tokens=32, output_tokens=8)


@pytest.fixture(scope="module")
def stack(demo_model, tmp_path_factory):
    with ClientStack(
        demo_model(preset="tiny"), tmp_path_factory.mktemp("clients-stack"), max_model_len=512
    ) as s:
        yield s


def _installed(name: str) -> runners.ClientInstall:
    install = runners.find_client(name, clients.client_venvs([]))
    if install is None:
        pytest.skip(
            f"{name} is not installed (set KVFLEET_CLIENT_VENVS={name}=VENV after: {runners.CLIENTS[name].install})"
        )
    return install


def _check_ok(row: dict, work: runners.Workload) -> None:
    assert row["status"] == "ok", (row["status"], row.get("log_tail"))
    assert row["returncode"] == 0 and row["requests"] == work.requests and row["failed"] == 0
    assert row["server"]["requests_ok"] == work.requests and row["server"]["requests_failed"] == 0
    # The client's usage-based count is exactly what the replica generated.
    assert row["usage_completion_tokens"] == row["server"]["completion_tokens"] > 0
    if row["target"] == "gateway":
        assert row["gateway_metered_completion_tokens"] == row["server"]["completion_tokens"]


@pytest.mark.parametrize("target", clients.TARGETS)
def test_openai_sdk_gets_exact_usage(stack: ClientStack, tmp_path: Path, target: str) -> None:
    install = runners.find_client("openai", {})
    assert install is not None and install.where == "current interpreter"
    row = clients.run_client(install, stack, target, FAST, tmp_path, timeout_s=120)
    _check_ok(row, FAST)
    # Every request's usage equals the logprob entries it received; the four request shapes were sent.
    assert row["per_request_exact"] is True
    records = json.loads((tmp_path / "openai.json").read_text())["records"]
    assert {r["shape"] for r in records} == set(runners_shapes())
    assert all(r["completion_tokens"] <= FAST.output_tokens for r in records)
    # Through the gateway the key is the tenant's; it never appears in the recorded argv.
    assert stack.api_key not in json.dumps(row["argv"])
    re = row["retokenized"]
    assert re["requests"] == FAST.requests and re["usage_tokens"] == row["usage_completion_tokens"]


def runners_shapes() -> tuple[str, ...]:
    from bench import _clients_openai

    return _clients_openai.SHAPES


def test_a_missing_client_is_reported_with_its_install_command(tmp_path: Path) -> None:
    assert runners.find_client("aiperf", {"aiperf": tmp_path / "no-venv"}) is None
    assert "aiperf==0.13.0" in runners.CLIENTS["aiperf"].install
    assert runners.parse_venv_list("aiperf=/a, guidellm=/b") == {"aiperf": Path("/a"), "guidellm": Path("/b")}
    with pytest.raises(ValueError):
        runners.parse_venv_list("curl=/x")


def test_judge_names_each_problem() -> None:
    row = {
        "returncode": 0, "requests": 8, "expected_requests": 8, "failed": 0,
        "server": {"requests_failed": 0, "completion_tokens": 64}, "usage_completion_tokens": 64,
    }  # fmt: skip
    assert clients.judge(row) == "ok"
    bad = {**row, "failed": 1, "usage_completion_tokens": 70, "gateway_metered_completion_tokens": 60}
    verdict = clients.judge(bad)
    assert (
        verdict.startswith("FAIL")
        and "1 failed" in verdict
        and "70 != 64" in verdict
        and "metered 60" in verdict
    )


def test_engine_counters_are_read_from_prometheus_text() -> None:
    text = "\n".join([
        '# TYPE kvfleet_engine_requests counter',
        'kvfleet_engine_requests_total{endpoint="chat",model_name="m",status="200"} 5.0',
        'kvfleet_engine_requests_total{endpoint="chat",model_name="m",status="400"} 2.0',
        '# TYPE kvfleet_engine_generation_tokens counter',
        'kvfleet_engine_generation_tokens_total{model_name="m"} 80.0',
        '# TYPE kvfleet_engine_cached_prompt_tokens counter',
        'kvfleet_engine_cached_prompt_tokens_total{model_name="m"} 32.0',
    ])  # fmt: skip
    c = parse_engine_counters(text)
    assert (c.requests_ok, c.requests_failed, c.generation_tokens, c.cached_prompt_tokens) == (5, 2, 80, 32)


# ---- the external clients (slow; skipped where their venvs are absent) --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["aiperf", "guidellm", "inference-perf"])
def test_external_client_smoke(request: pytest.FixtureRequest, tmp_path: Path, name: str) -> None:
    install = _installed(name)  # before the stack: a skip starts no servers
    stack = request.getfixturevalue("stack")
    for target in clients.TARGETS:
        row = clients.run_client(install, stack, target, SMALL, tmp_path / target, timeout_s=600)
        _check_ok(row, SMALL)
        assert stack.api_key not in json.dumps(row["argv"])
        if name in ("aiperf", "inference-perf"):
            # Both also count the tokens of the output text with their own tokenizer (reported, not judged).
            assert row["tokenized_completion_tokens"] > 0
