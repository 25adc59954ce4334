"""Architecture name (config.json ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from kvfleet_engine.config import ModelConfig
from kvfleet_engine.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are the Llama block; the differences (q/k/v bias, rope theta, window) are config.
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r} in {cfg.path}/config.json; "
            f"kvfleet supports: {', '.join(supported_architectures())}"
        )
    return cls
