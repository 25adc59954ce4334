"""Device helpers of the engine tests, on top of ``test_device`` (tests/conftest.py, KVFLEET_TEST_DEVICE).

Exact-parity tests pin float32 on both sides (the engine's ``dtype="auto"`` is bfloat16 on CUDA);
bfloat16 is checked against tolerances in test_bf16_agreement.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def on_cuda(test_device: str) -> bool:
    return test_device.startswith("cuda")


@pytest.fixture(scope="session")
def require_gpus(test_device: str) -> Callable[[int], None]:
    """require_gpus(world): skip, saying why, when the test device is CUDA and fewer than ``world`` GPUs
    are visible from it (a TP x PP engine takes one GPU per rank). On the CPU every rank is a process
    on the same CPU (gloo), so nothing is skipped there."""

    def check(world: int) -> None:
        if not test_device.startswith("cuda"):
            return
        import torch

        first = int(test_device.partition(":")[2] or 0)
        have = torch.cuda.device_count() - first
        if have < world:
            pytest.skip(
                f"TP x PP = {world} ranks need {world} GPUs from {test_device}; {have} visible "
                "(KVFLEET_TEST_DEVICE=cpu runs them as CPU processes)"
            )

    return check


@pytest.fixture(scope="session")
def hf_float32(test_device: str) -> Callable[[Path], object]:
    """hf_float32(path): the HF transformers reference of a model dir, float32 with eager attention, on
    the test device (the engine and its reference see the same device's arithmetic)."""

    def load(path: Path):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        return model.to(test_device).eval()

    return load


@pytest.fixture
def triton_device(test_device: str) -> str:
    """The test device, for a test of Triton kernels. CPU tensors reach them only through the interpreter
    (TRITON_INTERPRET=1, which tests/conftest.py sets where torch sees no CUDA): on a CUDA machine testing
    the CPU, Triton compiles for the GPU, so such a test is skipped (KVFLEET_TEST_DEVICE=cuda runs it)."""
    pytest.importorskip("triton")
    if test_device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1; KVFLEET_TEST_DEVICE=cuda runs them"
        )
    return test_device


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory, test_device):
    """An engine server process on the tiny llama model (max_model_len 1024) for a whole test module: the
    API tests of tools, structured outputs and logit_bias share its shape. A module may define its own.
    On the test device (left to itself, the server takes the GPU of a GPU machine)."""
    from tests.server.server_harness import run_server

    logs = tmp_path_factory.mktemp("logs")
    with run_server(
        demo_model("llama", "tiny"), logs, "--max-model-len", "1024", "--device", test_device
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    from tests.server.server_harness import openai_client

    return openai_client(server)
