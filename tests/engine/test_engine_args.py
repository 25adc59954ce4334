"""EngineArgs: the one declaration of the engine's settings, and what is generated from it (the command line
of `kvfleet engine serve` / `kvfleet generate`, the keyword arguments of ``LLM``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from kvfleet_engine.engine_args import EngineArgs, SimulationCost
from kvfleet_engine.generate_cli import generate_main
from kvfleet_engine.server.serve_cli import build_parser


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return p


def parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(engine_parser().parse_args(argv))


def test_the_flags_default_to_the_fields_defaults():
    assert parse(["--model", "m"]) == EngineArgs("m")
    with pytest.raises(SystemExit):
        engine_parser().parse_args([])  # --model is required


def test_every_spelling_in_use_sets_its_field():
    args = parse(
        ["--model", "m", "--dtype", "float16", "--device", "cuda:1", "--block-size", "32", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--max-model-len", "512", "--num-kv-blocks", "100",
         "--no-enable-prefix-caching", "--seed", "7", "--scheduling-policy", "priority",
         "--attention-backend", "torch", "--gpu-memory-utilization", "0.5", "-tp", "2", "-pp", "4",
         "--enforce-eager", "--simulate", "--sim-prefill-ms-per-1k-tokens", "1", "--sim-decode-ms-per-step", "2",
         "--sim-decode-ms-per-seq", "3", "--sim-step-overhead-ms", "4"]
    )  # fmt: skip
    assert args == EngineArgs(
        "m", dtype="float16", device="cuda:1", block_size=32, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=512, num_kv_blocks=100, enable_prefix_caching=False, seed=7, scheduling_policy="priority",
        attention_backend="torch", gpu_memory_utilization=0.5, tensor_parallel_size=2, pipeline_parallel_size=4,
        enforce_eager=True, simulation=SimulationCost(1, 2, 3, 4),
    )  # fmt: skip
    assert parse(
        ["--model", "m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]
    ) == EngineArgs("m", tensor_parallel_size=2, pipeline_parallel_size=3)
    assert parse(["--model", "m", "--simulate"]).simulation == SimulationCost()


def test_choices_are_enforced():
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--scheduling-policy", "lifo"])


@pytest.mark.parametrize(
    "values",
    [
        {"model": "m"},
        {"model": "m", "enable_prefix_caching": True, "enforce_eager": False, "max_model_len": None},
        {
            "model": "/models/x", "dtype": "bfloat16", "device": "cpu", "block_size": 8, "max_num_seqs": 4,
            "max_num_batched_tokens": 32, "max_model_len": 64, "num_kv_blocks": 9, "kv_cache_memory_bytes": 2**20,
            "enable_prefix_caching": False, "seed": 5, "scheduling_policy": "priority",
            "attention_backend": "triton", "gpu_memory_utilization": 0.25, "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2, "enforce_eager": True, "simulation": SimulationCost(0, 0, 0.5, 0),
        },
    ],
)  # fmt: skip
def test_cli_args_parse_back_to_the_same_settings(values):
    assert parse(EngineArgs.cli_args(values)) == EngineArgs(**values)


def test_cli_args_refuse_what_no_flag_says():
    with pytest.raises(ValueError, match="no command-line flag"):
        EngineArgs.cli_args({"model": "m", "distributed_executor_backend": "mp"})
    with pytest.raises(ValueError, match="not engine settings: max_num_seq"):
        EngineArgs.cli_args({"model": "m", "max_num_seq": 3})
    with pytest.raises(ValueError, match="no command-line spelling"):
        EngineArgs.cli_args({"model": "m", "seed": None})


def test_option_strings_are_the_parsers():
    parser_options = {a.dest: set(a.option_strings) for a in engine_parser()._actions if a.dest != "help"}
    for f in dataclasses.fields(EngineArgs):
        flags = set(EngineArgs.option_strings(f.name))
        if f.name == "simulation":
            assert flags == {o for d, opts in parser_options.items() if d.startswith("sim") for o in opts}
        elif f.metadata["cli"]:
            assert flags == parser_options[f.name]
        else:
            assert flags == set() and f.name not in parser_options


def test_serve_and_generate_take_the_engine_flags():
    engine = {o for a in engine_parser()._actions for o in a.option_strings}
    assert engine <= {o for a in build_parser()._actions for o in a.option_strings}


def test_unknown_settings_are_a_type_error():
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs("m", max_num_seq=3)
    with pytest.raises(TypeError):
        EngineArgs("m", "float16")  # every setting but the model is keyword-only


def test_llm_keywords_are_engine_args(demo_model):
    from kvfleet_engine import LLM

    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(demo_model("llama", "tiny"), max_num_seq=3)


def test_generate_runs_a_simulated_replica_from_the_command_line(demo_model, capsys):
    argv = ["--model", str(demo_model("llama", "tiny")), "--simulate", "--sim-decode-ms-per-step", "0",
            "--sim-prefill-ms-per-1k-tokens", "0", "--max-model-len", "128", "--prompt", "hi", "--max-tokens",
            "3", "--json"]  # fmt: skip
    assert generate_main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert len(json.loads(line)["token_ids"]) == 3


def test_importing_engine_args_pulls_no_torch():
    code = "import sys, kvfleet_engine.engine_args\nassert 'torch' not in sys.modules, 'torch imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)
