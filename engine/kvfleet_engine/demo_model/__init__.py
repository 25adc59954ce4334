"""Random-weight Hugging Face models for tests and benchmarks (``kvfleet demo-model``).

Real checkpoints cannot be downloaded here, so tests and benchmarks build their models: a byte-level BPE
tokenizer trained on the bundled corpus (4096 entries, ChatML chat template), a Llama / Qwen2 / Mistral
``config.json`` at one of three sizes, and deterministic random weights initialised so that greedy decoding
has a large top-1/top-2 logit gap and a varied output (see ``weights``). ``transformers`` loads the result
with ``AutoModelForCausalLM`` / ``AutoTokenizer``; so does the kvfleet engine.

Modules: ``tokenizer`` (training, special tokens, chat template), ``presets`` (shapes, config.json,
parameter counts), ``weights`` (the initialisation scheme), ``checkpoint`` (streaming safetensors writer,
HF sharding), ``builder`` (``build_demo_model``), ``cli`` (``main``).
"""

from kvfleet_engine.demo_model.builder import BuildResult, build, build_demo_model
from kvfleet_engine.demo_model.demo_model_cli import main
from kvfleet_engine.demo_model.presets import ARCHS, DTYPES, PRESETS, count_parameters, make_config

__all__ = [
    "ARCHS",
    "DTYPES",
    "PRESETS",
    "BuildResult",
    "build",
    "build_demo_model",
    "count_parameters",
    "main",
    "make_config",
]
