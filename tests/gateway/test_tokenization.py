"""The gateway's tokenization: the ids the engine will see, computed cheaply."""

import pytest


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_gateways_fast_encode_equals_the_tokenizers(demo_model, arch):
    """The gateway encodes through the Rust tokenizer directly; the ids must equal ``tokenizer.encode``
    (what the engine uses) with and without special tokens, for every demo architecture."""
    from transformers import AutoTokenizer

    from kvfleet_gateway.tokenization import _encode

    tok = AutoTokenizer.from_pretrained(demo_model(arch, "tiny"))
    texts = ["hello world", "", "  spaces  and\\nnewlines\\t", "naïve café 東京 🙂", "<|im_start|>user hi"]
    texts.append(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False))
    for text in texts:
        for special in (True, False):
            assert _encode(tok, text, special) == tok.encode(text, add_special_tokens=special), (
                text,
                special,
            )
