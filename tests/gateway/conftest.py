
import pytest

from tests.gateway.gateway_harness import Fleet


@pytest.fixture(scope="module")
def fleet(demo_model, tmp_path_factory):
    """Real Redis + two real tiny engine replicas + one gateway, shared by a test module."""
    with Fleet(demo_model("llama", "tiny"), tmp_path_factory.mktemp("fleet")) as f:
        f.start_engines(2)
        f.start_gateway()
        yield f
