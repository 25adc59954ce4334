"""``bench/serve.py`` and its helpers: the load generator against real servers on the tiny demo model (a few
requests, JSON checked for sane fields, no wall-clock assertions), the pure statistics and workload
functions, and process-group clean-up of a server that ignores SIGTERM."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bench import _serve_common as sc
from bench import _servers as servers
from bench import serve, sleep_wake


@pytest.fixture(autouse=True)
def _restore_threads():
    import torch

    n = torch.get_num_threads()  # the script sets torch's thread count for its contention probe
    yield
    torch.set_num_threads(n)


def _no_process_left(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or servers._state(pid) == "Z"


def _check_target(data: dict, name: str, requests: int, input_len: int | None, output_len: int) -> None:
    t = data["targets"][name]
    assert "error" not in t, t.get("error")
    s = t["summary"]
    assert s["requests"] == s["completed"] == requests and s["failed"] == 0 and s["errors"] == {}
    assert s["output_tokens_exact"] is True and s["output_tokens_per_request"] == [output_len]
    assert s["output_tokens"] == requests * output_len
    if input_len is not None:
        assert s["prompt_tokens_as_built"] is True and s["prompt_tokens_per_request"] == [input_len]
    assert s["finish_reasons"] == {"length": requests}
    assert s["output_tok_s"] > 0 and s["request_throughput"] > 0 and s["wall_s"] > 0
    for dist in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert s[dist]["n"] == requests, dist
        assert 0 < s[dist]["p50"] <= s[dist]["p99"] <= s[dist]["max"], dist
    assert s["itl_ms"]["n"] > 0 and s["itl_ms"]["p50"] <= s["itl_ms"]["p99"]
    # A request's first text chunk comes before its last byte.
    for r in t["requests"]:
        assert r["ok"] and 0 < r["ttft"] <= r["e2e"]
    assert t["warmup"]["completed"] == data["workload"]["warmup_requests"]
    assert t["startup_s"] > 0 and t["memory_idle"]["pss_bytes"] > 0
    assert t["needed_sigkill"] is False  # it shut down on SIGTERM
    assert _no_process_left(t["server_pid"])
    assert all(_no_process_left(int(p)) for p in t["memory_after"]["processes"])


def test_serve_bench_kvfleet_smoke(tmp_path: Path, demo_model) -> None:
    model = demo_model(preset="tiny")
    out = tmp_path / "serve.json"
    argv = [
        "--target", "kvfleet", "--model", str(model), "--num-requests", "6", "--warmup-requests", "1",
        "--concurrency", "3", "--input-len", "20", "--output-len", "8", "--max-model-len", "128",
        "--log-dir", str(tmp_path / "logs"), "--out", str(out), "--startup-timeout", "120",
    ]  # fmt: skip
    result = serve.main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result, default=str))
    assert data["benchmark"] == "serve" and data["command"].startswith(
        ".venv/bin/python -m bench.serve --target"
    )
    assert list(data["targets"]) == ["kvfleet"] and "ratios" not in data
    _check_target(data, "kvfleet", 6, 20, 8)
    body = data["targets"]["kvfleet"]["request_example"]
    assert body["min_tokens"] == body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert body["model"] == "kvfleet-bench" and body["stream_options"] == {"include_usage": True}


@pytest.mark.slow
def test_serve_bench_compare_open_loop_chat(tmp_path: Path, demo_model) -> None:
    """Both servers in one run, open loop, chat endpoint: ratios computed from the two summaries."""
    model = demo_model(preset="tiny")
    out = tmp_path / "serve.json"
    argv = [
        "--compare", "--model", str(model), "--endpoint", "chat", "--num-requests", "6", "--warmup-requests", "1",
        "--request-rate", "20", "--input-len", "16", "--output-len", "6", "--log-dir", str(tmp_path / "logs"),
        "--out", str(out), "--startup-timeout", "180",
    ]  # fmt: skip
    serve.main(argv)
    data = json.loads(out.read_text())
    assert list(data["targets"]) == ["transformers", "kvfleet"]
    for name in data["targets"]:
        _check_target(data, name, 6, None, 6)  # chat: the template adds prompt tokens
    kv, hf = (data["targets"][n]["summary"] for n in ("kvfleet", "transformers"))
    assert kv["prompt_tokens_per_request"] == hf["prompt_tokens_per_request"]  # same template, same tokenizer
    r = data["ratios"]
    assert math.isclose(r["output_tok_s"], kv["output_tok_s"] / hf["output_tok_s"])
    assert math.isclose(r["ttft_p50"], kv["ttft_ms"]["p50"] / hf["ttft_ms"]["p50"])
    assert set(data["targets_met"]) == {"throughput", "ttft"}
    assert "generation_config" in data["targets"]["transformers"]["request_example"]


# ---- pure helpers ----------------------------------------------------------------------------------


def test_prompts_have_exact_token_length_and_are_deterministic(demo_model) -> None:
    tok = sc.load_tokenizer(demo_model(preset="tiny"))
    words = sc.word_pool(tok)
    a = sc.make_prompts(tok, 12, 37, seed=3, words=words)
    assert a == sc.make_prompts(tok, 12, 37, seed=3, words=words)
    assert a != sc.make_prompts(tok, 12, 37, seed=4, words=words)
    assert len(set(a)) == 12
    assert all(len(tok.encode(p, add_special_tokens=False)) == 37 for p in a)
    with pytest.raises(ValueError):
        sc.make_prompts(tok, 1, 0, seed=0, words=words)


def test_percentile_and_summary() -> None:
    assert sc.percentile([], 50) is None
    assert sc.percentile([5.0], 99) == 5.0
    assert sc.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert sc.percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    ok = [
        sc.RequestResult(
            sent=0.0, ok=True, ttft=0.1, itls=[0.01, 0.03], e2e=0.5, prompt_tokens=10, output_tokens=5
        ),
        sc.RequestResult(
            sent=0.0, ok=True, ttft=0.3, itls=[0.02], e2e=0.7, prompt_tokens=10, output_tokens=5
        ),
    ]
    bad = sc.RequestResult(sent=0.0, error="HTTP 503: asleep")
    s = sc.summarize([*ok, bad], wall_s=2.0, expected_prompt_tokens=10, expected_output_tokens=5)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 503: asleep": 1}
    assert s["output_tok_s"] == 5.0 and s["request_throughput"] == 1.0 and s["total_tok_s"] == 15.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["itl_ms"]["n"] == 3
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (0.7-0.3)/4
    assert s["output_tokens_exact"] is True and s["prompt_tokens_as_built"] is True
    short = sc.summarize([ok[0]], 1.0, 10, expected_output_tokens=6)
    assert short["output_tokens_exact"] is False


def test_poisson_offsets() -> None:
    xs = sc.poisson_offsets(2000, rate=4.0, seed=1)
    assert xs == sc.poisson_offsets(2000, rate=4.0, seed=1) and xs[0] == 0.0
    assert xs == sorted(xs)
    assert 450 < xs[-1] < 550  # 1999 gaps of mean 0.25 s
    assert sc.poisson_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        sc.poisson_offsets(3, 0.0, 0)


def test_generation_extras_and_bodies() -> None:
    assert sc.generation_extras("kvfleet", 7) == {"min_tokens": 7, "ignore_eos": True}
    hf = json.loads(sc.generation_extras("transformers-cb", 7)["generation_config"])
    assert hf == {"do_sample": False, "eos_token_id": -1}
    with pytest.raises(ValueError):
        sc.generation_extras("vllm?", 7)
    body = sc.request_body("chat", "m", "hi", 7, {"ignore_eos": True})
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["stream"] is True
    assert sc.request_body("completions", None, "hi", 7, {})["prompt"] == "hi"


def test_server_process_group_is_stopped_even_if_it_ignores_sigterm(tmp_path: Path) -> None:
    """A leader that spawns a child which ignores SIGTERM: stop() leaves neither behind."""
    script = tmp_path / "server.py"
    script.write_text(
        textwrap.dedent(
            """
            import signal, subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child up', flush=True); time.sleep(600)"])
            print(child.pid, flush=True)
            time.sleep(600)
            """
        )
    )
    cmd = servers.ServerCommand("fake", [sys.executable, str(script)], {}, "http://127.0.0.1:9", None, "none")
    proc = servers.ServerProcess(cmd, tmp_path / "fake.log").start()
    deadline = time.monotonic() + 30
    while "child up" not in proc.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(proc.log_tail().splitlines()[0])
    assert servers.process_tree(proc.pid) == [proc.pid, child]
    assert servers.tree_memory(proc.pid)["rss_bytes"] > 0
    proc.stop(grace_s=5.0, linger_s=0.5)
    assert proc.needed_sigkill is True  # the child outlived SIGTERM
    deadline = time.monotonic() + 10
    while not _no_process_left(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _no_process_left(proc.pid) and _no_process_left(child)


def test_wait_ready_reports_a_server_that_exits(tmp_path: Path) -> None:
    cmd = servers.ServerCommand(
        "fake",
        [sys.executable, "-c", "print('bad flag'); raise SystemExit(2)"],
        {},
        "http://127.0.0.1:9",
        None,
        "none",
    )
    with (
        servers.ServerProcess(cmd, tmp_path / "fake.log") as proc,
        pytest.raises(servers.ServerExited, match="bad flag"),
    ):
        proc.wait_ready(timeout_s=30)


@pytest.mark.slow
def test_sleep_wake_bench_smoke(tmp_path: Path, demo_model) -> None:
    out = tmp_path / "sleep_wake.json"
    argv = [
        "--model", str(demo_model(preset="tiny")), "--cycles", "1", "--prompt-len", "12", "--output-len", "4",
        "--max-model-len", "128", "--log-dir", str(tmp_path / "logs"), "--out", str(out), "--startup-timeout", "120",
    ]  # fmt: skip
    sleep_wake.main(argv)
    data = json.loads(out.read_text())
    assert "error" not in data, data.get("error")
    assert data["server_command"].startswith("KVFLEET_ADMIN_TOKEN=<token> ")  # in the environment, not argv
    assert "--admin-token" not in data["server_command"]
    cold = data["cold_start"]
    assert 0 < cold["ready_s"] < cold["to_first_token_s"]
    assert [c["level"] for c in data["cycles"]] == [1, 2]
    for level in ("1", "2"):
        s = data["levels"][level]
        assert s["outputs_identical"] and s["refused_while_asleep"]
        assert s["sleep_s"] > 0 and s["wake_s"] > 0 and s["wake_to_first_token_s"] > s["wake_s"]
        assert s["speedup_vs_cold_start"] == pytest.approx(
            cold["to_first_token_s"] / s["wake_to_first_token_s"]
        )
        assert s["freed_median"]["device_memory_kv_cache"] > 0  # both levels drop the KV cache
    assert data["levels"]["2"]["freed_median"]["device_memory_weights"] > 0  # level 2 discards the weights
    assert all(c["is_sleeping_while_asleep"] is True for c in data["cycles"])
    assert data["needed_sigkill"] is False and isinstance(data["target_met"], bool)
