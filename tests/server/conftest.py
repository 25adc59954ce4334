import pytest

from tests.server.server_harness import openai_client, run_server


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    """One engine server on the tiny llama model for a whole test module."""
    with run_server(
        demo_model("llama", "tiny"), tmp_path_factory.mktemp("logs"), "--max-model-len", "512"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)
