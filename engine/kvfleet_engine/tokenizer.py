"""Tokenizer loading (transformers' fast tokenizer: the same one HF and the gateway use)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises several types for a missing/broken tokenizer
        raise ValueError(f"cannot load the tokenizer from {model_dir}: {e}") from e
