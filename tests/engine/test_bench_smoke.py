"""Smoke tests for the benchmark scripts in ``bench/``: each ``main()`` runs end to end on the tiny demo
model with a handful of requests and writes JSON with the expected keys. No timing assertions."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _load(name: str):
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared by both tests: the first builds the tiny demo model, the second reuses it.
    return tmp_path_factory.mktemp("bench-models")


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()  # the scripts set torch's thread count
    yield
    torch.set_num_threads(n)


def test_engine_throughput_smoke(tmp_path: Path, model_cache: Path) -> None:
    mod = _load("engine_throughput")
    out = tmp_path / "engine_throughput.json"
    argv = [
        "--preset", "tiny", "--model-cache", str(model_cache), "--num-prompts", "4",
        "--min-prompt", "8", "--max-prompt", "24", "--min-output", "2", "--max-output", "6",
        "--hf-batch-sizes", "2", "--matmul-n", "128", "--matmul-reps", "2", "--out", str(out),
    ]  # fmt: skip
    result = mod.main(argv)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "engine_throughput"
    assert data == json.loads(json.dumps(result, default=str))
    for key in ("config", "model", "params", "workload", "machine", "env", "systems", "hf_best",
                "speedup_vs_hf_best", "efficiency", "targets", "sanity", "notes"):  # fmt: skip
        assert key in data, key
    assert (model_cache / "llama-tiny-s0" / "config.json").is_file()
    params = data["params"]
    assert params["flop_params"] == params["non_embedding"] + params["lm_head"] > 0
    assert data["machine"]["peak_flops"] > 0
    wl = data["workload"]
    assert wl["num_prompts"] == 4 and wl["total_tokens"] == wl["prompt_tokens"] + wl["output_tokens"]

    systems = data["systems"]
    assert set(systems) == {"kvfleet", "hf-static-bs2", "hf-continuous"}
    metrics = (
        "wall_s",
        "output_tok_s",
        "total_tok_s",
        "efficiency",
        "speedup_vs_hf_best",
        "generated_tokens",
    )
    for name in ("kvfleet", "hf-static-bs2"):  # HF continuous batching may record an error instead
        assert "error" not in systems[name], systems[name]
    for name, s in systems.items():
        if "error" in s:
            assert name == "hf-continuous" and isinstance(s["error"], str)
            continue
        for m in metrics:
            assert m in s, (name, m)
        assert s["generated_tokens"] == wl["output_tokens"], name
    assert data["hf_best"]["system"] in systems
    assert isinstance(data["speedup_vs_hf_best"], float)
    assert isinstance(data["targets"]["speedup_met"], bool) and isinstance(
        data["targets"]["efficiency_met"], bool
    )
    assert "kvfleet vs hf-static-bs2" in data["sanity"]


def test_prefix_cache_smoke(tmp_path: Path, model_cache: Path) -> None:
    mod = _load("prefix_cache")
    out = tmp_path / "prefix_cache.json"
    argv = [
        "--preset", "tiny", "--model-cache", str(model_cache), "--num-prompts", "4",
        "--prefix-len", "32", "--suffix-len", "16", "--output-len", "3", "--rounds", "2", "--out", str(out),
    ]  # fmt: skip
    mod.main(argv)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "prefix_cache"
    for key in (
        "config",
        "model",
        "engine",
        "env",
        "scenarios",
        "speedup_shared",
        "slowdown_pct_no_share",
        "targets",
    ):
        assert key in data, key
    assert set(data["scenarios"]) == {"shared", "no-share"}
    for sc in data["scenarios"].values():
        for key in ("speedup", "slowdown_pct", "speedup_per_round", "outputs_identical", "on", "off"):
            assert key in sc, key
        assert len(sc["speedup_per_round"]) == 2
        for setting in ("on", "off"):
            x = sc[setting]
            for key in ("walls_s", "median_s", "min_s", "max_s", "hit_rate", "total_tok_s", "prompt_tokens"):
                assert key in x, key
            assert len(x["walls_s"]) == 2
            assert x["prompt_tokens"] == 4 * 48 and x["generated_tokens"] == 4 * 3
        assert sc["off"]["hit_rate"] == 0.0
        assert 0.0 <= sc["on"]["hit_rate"] <= 1.0
    assert isinstance(data["targets"]["speedup_met"], bool)
    assert isinstance(data["targets"]["slowdown_met"], bool)


def test_kv_eviction_bench_prefers_reused_prefixes(tmp_path: Path) -> None:
    mod = _load("kv_eviction")
    out = tmp_path / "kv_eviction.json"
    # 5 prompts of 4 blocks in a 24-block cache: plain LRU loses prompts to the private blocks of
    # finished requests; the segmented LRU keeps them (the property the bench measures).
    result = mod.main(["--blocks", "24", "--block-size", "4", "--prefix", "16", "--private", "12",
                       "--requests", "300", "--concurrency", "1", "--groups", "5", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert result["never_worse"]
    uniform = next(r for r in result["rows"] if r["scenario"] == "uniform")
    assert uniform["segmented-lru"] > uniform["lru"]
