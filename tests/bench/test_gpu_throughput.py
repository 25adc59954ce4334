"""``bench/gpu_throughput.py``: a tiny CPU run of all four systems (kvfleet offline, the kvfleet server as a real
subprocess, HF static batching, HF ``generate_batch``) with its JSON checked (token counts, ratios, targets;
no wall-clock assertions), and its pure helpers (engine/server flags, target evaluation)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bench import _offline as offline  # noqa: E402  (after the skips above)
from bench import _servers as servers  # noqa: E402
from bench import gpu_throughput as gt  # noqa: E402

SYSTEMS = ("kvfleet-offline", "kvfleet-server", "hf-static", "hf-continuous")


def test_gpu_throughput_cpu_smoke(tmp_path: Path, demo_model) -> None:
    model = demo_model(arch="qwen2", preset="tiny")
    out = tmp_path / "gpu_throughput.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--model", str(model),
        "--num-requests", "8", "--min-prompt", "8", "--max-prompt", "32", "--min-output", "4", "--max-output", "16",
        "--log-dir", str(tmp_path / "logs"), "--startup-timeout", "120", "--out", str(out),
    ]  # fmt: skip
    result = gt.main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result, default=str))
    assert data["benchmark"] == "gpu_throughput"
    assert data["card"] == "cpu" and data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["preset"] == "tiny" and data["arch"] == "qwen2"
    assert data["torch"] == torch.__version__ and data["transformers"] == transformers.__version__

    # The workload is engine_throughput's generator: the same seed gives the same asked tokens.
    outs = offline.make_workload(model, 8, (8, 32), (4, 16), 0).outs
    wl = data["workload"]
    assert wl["num_requests"] == 8 and wl["output_tokens"] == sum(outs)
    assert wl["prompt_len"] == [8, 32] and wl["output_len"] == [4, 16]

    systems = data["systems"]
    assert list(systems) == list(SYSTEMS)
    for name, s in systems.items():
        assert "error" not in s, (name, s.get("error"))
        assert s["generated_tokens"] == wl["output_tokens"], name
        assert s["tokens_match_workload"] is True
        assert s["wall_s"] > 0
        assert math.isclose(s["output_tok_s"], s["generated_tokens"] / s["wall_s"])
        hf, kv = systems["hf-static"]["output_tok_s"], systems["kvfleet-offline"]["output_tok_s"]
        assert math.isclose(s["vs_hf_static"], s["output_tok_s"] / hf), name
        assert math.isclose(s["vs_kvfleet_offline"], s["output_tok_s"] / kv), name
    assert (
        systems["hf-static"]["vs_hf_static"] == 1.0
        and systems["kvfleet-offline"]["vs_kvfleet_offline"] == 1.0
    )
    assert systems["hf-static"]["batch_size"] == 8  # every request in one padded batch
    assert systems["hf-continuous"]["api"] == "generate_batch"

    srv = systems["kvfleet-server"]
    assert srv["requests_with_other_output_tokens"] == 0 and srv["prompt_tokens_as_sent"] is True
    assert srv["finish_reasons"] == ["length"] and srv["stream"] is False
    assert srv["needed_sigkill"] is False and "--dtype float32 --device cpu" in srv["command"]
    assert "--enforce-eager" not in srv["command"]

    t = data["targets"]
    assert math.isclose(t["offline_output_tok_s"]["value"], systems["kvfleet-offline"]["output_tok_s"])
    assert math.isclose(t["offline_vs_hf_static"]["value"], systems["kvfleet-offline"]["vs_hf_static"])
    assert math.isclose(t["server_vs_offline"]["value"], srv["vs_kvfleet_offline"])
    assert t["offline_output_tok_s"]["target"] == 20_000 and t["offline_vs_hf_static"]["target"] == 8
    assert t["server_vs_offline"]["target"] == 0.9
    for v in t.values():
        assert v["met"] == (v["value"] >= v["target"])
    assert data["all_met"] == all(v["met"] for v in t.values())
    # Greedy float32 on the same weights: kvfleet and HF agree token for token.
    for name in ("kvfleet-offline vs hf-static", "kvfleet-offline vs hf-continuous"):
        c = data["sanity"][name]
        assert c["exact_matches"] == c["compared"] == 4, c


# ---- pure helpers ----------------------------------------------------------------------------------


def test_engine_args_and_server_flags_pass_enforce_eager_only_when_asked() -> None:
    args = gt.parse_args(["--max-prompt", "200", "--max-output", "150"])
    assert args.max_model_len == 350 and args.dtype == "bfloat16" and args.preset == "bench"
    assert args.arch == "qwen2" and args.num_requests == 256 and args.hf_batch_size is None
    kw = gt.engine_args(args, "cuda")
    assert kw == {"dtype": "bfloat16", "device": "cuda", "max_num_seqs": 256, "max_model_len": 350}
    assert gt.server_flags(args, "cuda") == [
        "--dtype",
        "bfloat16",
        "--device",
        "cuda",
        "--max-num-seqs",
        "256",
    ]

    args = gt.parse_args(
        [
            "--enforce-eager",
            "--async-scheduling",
            "--max-num-batched-tokens",
            "4096",
            "--server-args",
            "--block-size 32",
        ]
    )
    kw = gt.engine_args(args, "cpu")
    assert kw["enforce_eager"] is True and kw["async_scheduling"] is True
    flags = gt.server_flags(args, "cpu")
    assert flags[-4:] == ["--enforce-eager", "--async-scheduling", "--block-size", "32"]
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "4096"
    # The flags are ones `kvfleet engine serve` parses.
    argv = servers.kvfleet_command(Path("/m"), 1, "x", extra_args=flags).argv
    from kvfleet_engine.server.serve_cli import build_parser

    parsed = build_parser().parse_args(argv[len(servers.kvfleet_argv()) + 2 :])  # past `kvfleet engine serve`
    assert parsed.enforce_eager is True and parsed.async_scheduling is True and parsed.block_size == 32


def _system(tokens: int, wall: float) -> dict:
    return {"generated_tokens": tokens, "wall_s": wall}


def test_evaluate_ratios_and_targets() -> None:
    systems = {
        "kvfleet-offline": _system(100_000, 4.0),  # 25,000 tok/s
        "kvfleet-server": _system(100_000, 5.0),  # 0.8x offline
        "hf-static": _system(100_000, 40.0),  # offline 10x
        "hf-continuous": {"error": "boom"},
    }
    v = gt.evaluate(systems, 100_000)
    t = v["targets"]
    assert t["offline_output_tok_s"] == {"target": 20_000, "value": 25_000, "met": True}
    assert t["offline_vs_hf_static"]["value"] == 10.0 and t["offline_vs_hf_static"]["met"] is True
    assert math.isclose(t["server_vs_offline"]["value"], 0.8) and t["server_vs_offline"]["met"] is False
    assert v["all_met"] is False
    assert (
        systems["hf-static"]["vs_kvfleet_offline"] == 0.1 and "output_tok_s" not in systems["hf-continuous"]
    )

    # A system that produced fewer tokens than asked cannot meet a target, whatever its rate.
    systems = {"kvfleet-offline": _system(99_999, 1.0), "kvfleet-server": _system(100_000, 1.0)}
    t = gt.evaluate(systems, 100_000)["targets"]
    assert t["offline_output_tok_s"]["met"] is False and t["server_vs_offline"]["met"] is False
    assert t["offline_vs_hf_static"] == {"target": 8.0, "value": None, "met": False}
