import sys
from pathlib import Path

import pytest

# the engine-server harness (run_server, process helpers) lives next to the server tests
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from gateway_harness import Fleet


@pytest.fixture(scope="module")
def fleet(demo_model, tmp_path_factory):
    """Real Redis + two real tiny engine replicas + one gateway, shared by a test module."""
    with Fleet(demo_model("llama", "tiny"), tmp_path_factory.mktemp("fleet")) as f:
        f.start_engines(2)
        f.start_gateway()
        yield f
