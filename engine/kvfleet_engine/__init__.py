"""kvfleet's inference engine: paged KV cache, continuous batching, prefix caching."""

from kvfleet_engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import kvfleet_engine` cheap for the CLI.
    if name == "LLM":
        from kvfleet_engine.llm import LLM

        return LLM
    raise AttributeError(name)
