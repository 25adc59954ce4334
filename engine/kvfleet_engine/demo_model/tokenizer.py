"""The demo models' tokenizer: a byte-level BPE trained deterministically on the bundled corpus.

The vocabulary is ``BPE_VOCAB_SIZE`` learned byte-level BPE entries (all 256 byte symbols first, then the
merges) followed by the three special tokens, so the full size is exactly ``VOCAB_SIZE`` and the special
tokens sit at the END of the id space (as in Qwen2), never at id 0:

    ``<|endoftext|>`` = 4093 (eos and pad), ``<|im_start|>`` = 4094, ``<|im_end|>`` = 4095.

Pipeline (the one transformers' Qwen2Tokenizer rebuilds, see ``PRETOKENIZE_REGEX``): NFC normalisation,
regex split, byte-level mapping, BPE without unknown token; ByteLevel decoder. Decoding the encoding of
an NFC string gives it back. No BOS token is prepended (``add_bos_token`` false, no template
post-processor). The chat template is ChatML.

Training is deterministic: the corpus files are read in sorted order, the BPE trainer breaks count ties
by pair ids, and no continuing-subword prefix (the trainer's one source of hash-order dependence) is
used; ``tests/engine/test_demo_model.py`` checks it by training in a second process.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CORPUS_DIR = Path(__file__).parent / "corpus"

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

VOCAB_SIZE = 4096
BPE_VOCAB_SIZE = VOCAB_SIZE - len(SPECIAL_TOKENS)
EOS_TOKEN_ID = BPE_VOCAB_SIZE  # 4093, also the pad token
IM_START_TOKEN_ID = BPE_VOCAB_SIZE + 1  # 4094
IM_END_TOKEN_ID = BPE_VOCAB_SIZE + 2  # 4095
PAD_TOKEN_ID = EOS_TOKEN_ID
# What generation stops on: end of text and end of a chat turn.
GENERATION_EOS_TOKEN_IDS: tuple[int, ...] = (EOS_TOKEN_ID, IM_END_TOKEN_ID)

# Pre-tokenization: contractions, letter runs (with one leading non-letter such as a space), single digits,
# punctuation runs, newline runs and other whitespace. This is the split Qwen2 models use, and it must be
# exactly that: transformers 5 loads a `model_type: qwen2` directory with its own Qwen2Tokenizer class,
# which keeps our vocabulary and merges but rebuilds the normalizer (NFC) and pre-tokenizer with this
# pattern, so any other split would make HF and `tokenizer.json` tokenize differently.
PRETOKENIZE_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# What the system turn says about tools: Hermes' format (the one Qwen2.5 models are trained on), in our
# words. The tools' JSON signatures follow it, one a line, then TOOLS_PROMPT_END. (Both are pasted into
# the template as single-quoted Jinja strings: no apostrophes; Jinja reads the escaped newlines and quotes.)
TOOLS_PROMPT = (
    "# Tools\\n\\nYou may call one or more functions to help with the request. "
    "Their JSON signatures are listed inside <tools></tools>:\\n<tools>"
)
TOOLS_PROMPT_END = (
    "\\n</tools>\\n\\nTo call functions, answer with one block per call, each holding a JSON object with "
    "the name of the function and its arguments:\\n<tool_call>\\n"
    '{\\"name\\": <function name>, \\"arguments\\": <arguments as a JSON object>}\\n</tool_call>'
)

# ChatML. `content` may be a string, null or a list of OpenAI-style parts ({"type": "text", "text": ...});
# the text parts are concatenated. A generation prompt opens an assistant turn.
# With `tools`, Hermes-style tool use: a system turn lists the tools (after the first system message's
# text, which it replaces); an assistant message's `tool_calls` follow its text as
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks (what the model is asked to write);
# consecutive `tool` messages form one user turn of `<tool_response>` blocks. `<tool_call>` and the
# others are plain text, not special tokens. Without tools or tool messages the output is plain ChatML,
# byte for byte what it was before tools existed.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' and messages[0]['content'] is string -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '" + TOOLS_PROMPT + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '" + TOOLS_PROMPT_END + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system' and message['content'] is string) -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}"
    "{%- set content = '' -%}"
    "{%- else -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if function['arguments'] is string -%}{{- function['arguments'] -}}"
    "{%- else -%}{{- function['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def corpus_files() -> list[Path]:
    """The training text files, in the fixed (sorted) order training reads them."""
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no tokenizer corpus under {CORPUS_DIR}")
    return files


@functools.cache
def _trained_tokenizer_json() -> str:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.trainers import BpeTrainer

    texts = [path.read_text(encoding="utf-8") for path in corpus_files()]
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        # Every byte is in the vocabulary, so any text (any language, emoji, binary junk) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"the corpus under {CORPUS_DIR} supports only {tok.get_vocab_size()} BPE entries, "
            f"{BPE_VOCAB_SIZE} are needed: add text"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for token, want in zip(SPECIAL_TOKENS, (EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID), strict=True):
        got = tok.token_to_id(token)
        if got != want:
            raise RuntimeError(f"special token {token} got id {got}, expected {want}")
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer size {tok.get_vocab_size(with_added_tokens=True)} != {VOCAB_SIZE}")
    return tok.to_str()


def build_tokenizer() -> Tokenizer:
    """Train (once per process; later calls copy the result) and return the demo tokenizer."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json())


def tokenizer_json_text() -> str:
    """``tokenizer.json`` as written to disk (the library's own serialisation, which is deterministic)."""
    return build_tokenizer().to_str(pretty=True) + "\n"


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: what ``transformers.AutoTokenizer`` needs to load ``tokenizer.json``."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in zip(SPECIAL_TOKENS, (EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID), strict=True)
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }


def write_tokenizer_files(out_dir: str | Path, model_max_length: int) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (chat template inside) and
    ``special_tokens_map.json`` into ``out_dir``; return the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer_json_text(),
        "tokenizer_config.json": _dump_json(tokenizer_config(model_max_length)),
        "special_tokens_map.json": _dump_json(special_tokens_map()),
    }
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def _dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
