"""IncrementalDetokenizer: streamed text == full decode, no partial characters, stop strings."""

from __future__ import annotations

import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from kvfleet_engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from kvfleet_engine.sampling_params import SamplingParams  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Café naïve résumé façade — “quotes” déjà vu!",
    "日本語のテキストです。中文文本，汉字很多。한국어 문장입니다. Ελληνικά και русский текст.",
    "Emojis: 😀😃😄 🚀🔥 👍🏽 👨‍👩‍👧 and more 🎉🎉 ✨ done.",
    "def main():\n    print('hello world')\n    return 42\n\n# stop here STOP or END.\n",
    "Numbers 3.14159 2718 and symbols <>&%$#@! ~`^ tabs\tand\nnewlines.",
]

SAMPLE_TEXTS = [
    "Hello, world! Café naïve — 日本語 😀 👨‍👩‍👧 done.",
    " leading space and trailing space ",
    "🚀🔥🎉✨👍🏽",
    "中文文本，汉字很多。한국어 문장입니다.",
    "Ελληνικά και русский текст: déjà vu, façade, résumé.",
    "def f(x):\n    return x * 2  # ünïcödé\n",
    "<|im_start|>assistant\nHi 😀<|im_end|>",
]


def _train_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def _train_metaspace_bpe() -> Tokenizer:
    # SentencePiece-style: "▁" marks a word start and the decoder drops it on the first token.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(CORPUS[:1] * 10, trainer)
    return tok


def _byte_fallback_tokenizer() -> Tokenizer:
    """Llama/Mistral-style: unknown characters become <0xHH> byte tokens, "▁" marks spaces."""
    vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(SPECIAL_TOKENS)}}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "▁a", "▁b", "é", "日", "▁hello", "x", "😀"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def _wrap(tok):
    if isinstance(tok, transformers.PreTrainedTokenizerBase):
        return tok
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _demo_tokenizer():
    """The demo model's tokenizer when that module exists (it is written separately)."""
    try:
        from kvfleet_engine.demo_model.tokenizer import build_tokenizer

        return _wrap(build_tokenizer())
    except Exception:
        return None


@pytest.fixture(scope="session")
def inline_tokenizer():
    return _wrap(_train_byte_level_bpe())


@pytest.fixture(scope="session", params=["inline", "demo"])
def tokenizer(request, inline_tokenizer):
    if request.param == "inline":
        return inline_tokenizer
    tok = _demo_tokenizer()
    if tok is None:
        pytest.skip("kvfleet_engine.demo_model.tokenizer is not available")
    return tok


@pytest.fixture(scope="session")
def metaspace_tokenizer():
    return _wrap(_train_metaspace_bpe())


# ---------------------------------------------------------------- helpers


def _byte_token_ids(tok) -> list[int]:
    """Token id of each single byte 0..255 (byte-level BPE keeps all 256 in its vocabulary)."""
    # GPT-2's byte <-> printable-char table: printable latin-1 bytes map to themselves, the others
    # to 256, 257, ... in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    vocab = tok.get_vocab()
    return [vocab[table[b]] for b in range(256)]


def _stream(detok, ids, chunk_sizes=(1,), rng=None, finish=True):
    """Feed ids in chunks; return (deltas, stop_reason)."""
    deltas, i, stop = [], 0, None
    while i < len(ids):
        n = rng.choice(chunk_sizes) if rng else chunk_sizes[0]
        stop = detok.update(ids[i : i + n])
        i += n
        finished = stop is not None or (finish and i >= len(ids))
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    if not ids and finish:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop


def _detok(tok, prompt=(), **kw):
    return IncrementalDetokenizer(tok, list(prompt), SamplingParams(**kw))


def _first_stop(text: str, stops: list[str]):
    """Reference: the stop string ending first in ``text`` (ties: the longest)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    return best


# ---------------------------------------------------------------- text == full decode


@pytest.mark.parametrize("skip_special", [True, False])
def test_encoded_text_streams_back_exactly(tokenizer, skip_special):
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special)
        d = _detok(tokenizer, skip_special_tokens=skip_special)
        deltas, stop = _stream(d, ids)
        assert stop is None
        assert "".join(deltas) == d.output_text == expected
        assert d.output_token_ids == ids
        assert all("\ufffd" not in delta for delta in deltas)  # valid text: never a partial char
        if skip_special:
            assert "<|im_end|>" not in d.output_text
        elif "<|im_end|>" in text:
            assert "<|im_end|>" in d.output_text


def test_random_token_sequences_match_full_decode(tokenizer):
    rng = random.Random(1234)
    vocab_size = tokenizer.backend_tokenizer.get_vocab_size()
    special_ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    for trial in range(300):
        n = rng.randint(0, 40)
        ids = [rng.randrange(vocab_size) for _ in range(n)]
        if trial % 3 == 0 and ids:  # sprinkle special tokens
            for _ in range(rng.randint(1, 3)):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(special_ids))
        skip = trial % 2 == 0
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        d = _detok(tokenizer, prompt, skip_special_tokens=skip)
        deltas, _ = _stream(d, ids, chunk_sizes=(1, 1, 2, 3, 5), rng=rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == d.output_text == expected, (ids, prompt, skip)


def test_split_characters_never_stream_partially(tokenizer):
    """Feed text one *byte token* at a time, so that every multi-byte character is split."""
    byte_ids = _byte_token_ids(tokenizer)
    for text in SAMPLE_TEXTS:
        ids = [byte_ids[b] for b in text.encode()]
        d = _detok(tokenizer, skip_special_tokens=True)
        emitted = ""
        for tid in ids:
            assert d.update([tid]) is None
            delta = d.get_next_output_text(finished=False, delta=True)
            assert "\ufffd" not in delta
            emitted += delta
            # what is out is always a prefix of the real text, ending on a whole character
            assert text.startswith(emitted)
        emitted += d.get_next_output_text(finished=True, delta=True)
        assert emitted == d.output_text == text == tokenizer.decode(ids)


def test_character_appears_once_complete(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    d = _detok(tokenizer)
    got = []
    for b in "a😀".encode():
        d.update([byte_ids[b]])
        got.append(d.get_next_output_text(finished=False, delta=True))
    assert got == ["a", "", "", "", "😀"]
    assert d.output_text == "a😀"


def test_invalid_utf8_is_released_on_finish(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    # A lone lead byte at the end never completes: it shows as U+FFFD once the request finishes.
    ids = [*tokenizer.encode("ok "), byte_ids[0xF0], byte_ids[0x9F]]
    d = _detok(tokenizer)
    deltas, _ = _stream(d, ids, finish=False)
    assert "".join(deltas) == d.output_text == "ok "
    deltas.append(d.get_next_output_text(finished=True, delta=True))
    assert "".join(deltas) == d.output_text == tokenizer.decode(ids) == "ok \ufffd"
    # Stray continuation bytes in the middle: U+FFFD, released as soon as text follows them.
    ids = [byte_ids[0x80], byte_ids[0x80], *tokenizer.encode("x")]
    d = _detok(tokenizer)
    deltas, _ = _stream(d, ids, finish=False)
    assert "".join(deltas) == tokenizer.decode(ids) == "\ufffd\ufffdx"


def test_long_invalid_run_keeps_window_short(tokenizer):
    """A model emitting invalid UTF-8 forever must not make each step re-decode everything."""
    byte_ids = _byte_token_ids(tokenizer)
    rng = random.Random(7)
    ids = [byte_ids[rng.choice([0x80, 0xBF, 0xF0, 0xE2, 0xC3])] for _ in range(500)]
    d = _detok(tokenizer)
    deltas, max_window = [], 0
    for tid in ids:
        d.update([tid])
        deltas.append(d.get_next_output_text(finished=False, delta=True))
        max_window = max(max_window, len(d._decode_ids) - d._prefix_offset)
    deltas.append(d.get_next_output_text(finished=True, delta=True))
    assert "".join(deltas) == d.output_text == tokenizer.decode(ids)
    assert max_window <= 64


def test_work_per_step_is_bounded(tokenizer):
    """O(new tokens) per update: the ids decoded per step do not grow with the output length."""
    ids = tokenizer.encode(" ".join(SAMPLE_TEXTS) * 20)
    assert len(ids) > 1000

    class CountingBackend:
        def __init__(self, inner):
            self.inner, self.decoded_ids = inner, 0

        def decode(self, ids, skip_special_tokens=False):
            self.decoded_ids += len(ids)
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    class Wrapper:
        backend_tokenizer = CountingBackend(tokenizer.backend_tokenizer)

    d = _detok(Wrapper(), skip_special_tokens=True)
    deltas, _ = _stream(d, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert Wrapper.backend_tokenizer.decoded_ids <= 12 * len(ids)


def test_byte_fallback_tokenizer_matches_full_decode():
    """<0xHH> byte tokens decode all-or-nothing per run (valid UTF-8, else one U+FFFD per byte):
    text is only committed once a run is closed, so even invalid runs stream correctly."""
    tok = _wrap(_byte_fallback_tokenizer())
    vocab = tok.get_vocab()
    pieces = ["a", "▁b", "é", "日本", "😀", "x", "ü", "▁hello", "<|im_end|>"]
    rng = random.Random(5)
    for trial in range(400):
        if trial % 2:  # valid text: characters outside the vocabulary as byte runs
            ids = []
            for piece in rng.choices(pieces, k=12):
                if piece in vocab:
                    ids.append(vocab[piece])
                else:
                    ids += [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
        else:  # anything, mostly bytes
            ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 40))]
        skip = rng.random() < 0.5
        d = _detok(tok, skip_special_tokens=skip)
        deltas, _ = _stream(d, ids, chunk_sizes=(1, 1, 2, 3), rng=rng)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == d.output_text == expected, (ids, skip)
        if trial % 2:
            assert all("\ufffd" not in delta for delta in deltas)


# ---------------------------------------------------------------- prompt context


def test_prompt_does_not_change_text_leading_space(metaspace_tokenizer):
    """Rule: output_text == tokenizer.decode(output ids) alone. A SentencePiece-style decoder drops
    the first output token's "▁" (as that decode does), later ones keep their space."""
    tok = metaspace_tokenizer
    prompt = tok.encode("The quick brown")
    out = tok.encode("fox jumps over the lazy dog.")
    first = tok.convert_ids_to_tokens(out[0])
    assert first.startswith("▁")
    expected = tok.decode(out)
    assert expected.startswith("fox jumps over")  # leading space dropped by the full decode
    for prompt_ids in ([], prompt):
        d = _detok(tok, prompt_ids)
        deltas, _ = _stream(d, out)
        assert "".join(deltas) == d.output_text == expected


def test_prompt_does_not_change_text_split_character(tokenizer):
    """A prompt that ends inside a character: the output's continuation bytes decode to U+FFFD, as
    ``tokenizer.decode(output_ids)`` gives (never the prompt's character)."""
    byte_ids = _byte_token_ids(tokenizer)
    emoji = "😀".encode()
    prompt = [*tokenizer.encode("say "), byte_ids[emoji[0]], byte_ids[emoji[1]]]
    out = [byte_ids[emoji[2]], byte_ids[emoji[3]], *tokenizer.encode(" hi")]
    d = _detok(tokenizer, prompt)
    deltas, _ = _stream(d, out)
    assert "".join(deltas) == d.output_text == tokenizer.decode(out)
    assert d.output_text.endswith(" hi") and "😀" not in d.output_text


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_basic(tokenizer, include):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    d = _detok(tokenizer, stop=["fox"], include_stop_str_in_output=include)
    deltas, stop = _stream(d, ids)
    assert stop == "fox" and d.stop_reason == "fox" and d.finished
    expected = "The quick brown fox" if include else "The quick brown "
    assert "".join(deltas) == d.output_text == expected
    # tokens after the match are ignored
    assert d.update(tokenizer.encode(" more")) is None
    assert d.output_text == expected


def test_stop_string_split_over_byte_tokens(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    text = "abc 日本語 def"
    ids = [byte_ids[b] for b in text.encode()]
    d = _detok(tokenizer, stop=["本語"])
    deltas, stop = _stream(d, ids)
    assert stop == "本語"
    assert "".join(deltas) == d.output_text == "abc 日"


def test_stop_earliest_end_wins(tokenizer):
    ids = tokenizer.encode("xx abcdef yy")
    # "cd" ends before "abcde" and "f"; the result is the same however the tokens are grouped.
    for chunk in (1, 2, len(ids)):
        d = _detok(tokenizer, stop=["abcde", "f", "cd"])
        _, stop = _stream(d, ids, chunk_sizes=(chunk,))
        assert stop == "cd" and d.output_text == "xx ab"
    # same end: the longest wins
    d = _detok(tokenizer, stop=["de", "bcde"], include_stop_str_in_output=True)
    _, stop = _stream(d, ids, chunk_sizes=(len(ids),))
    assert stop == "bcde" and d.output_text == "xx abcde"


def test_stop_strings_random_against_reference(tokenizer):
    rng = random.Random(99)
    for trial in range(200):
        text = rng.choice(SAMPLE_TEXTS + CORPUS)
        ids = tokenizer.encode(text)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                i = rng.randrange(len(full))
                stops.append(full[i : i + rng.randint(1, 6)])
            else:
                stops.append("zzz不存在")
        include = rng.random() < 0.5
        d = _detok(tokenizer, stop=stops, include_stop_str_in_output=include)
        deltas, stop = _stream(d, ids, chunk_sizes=(1, 1, 2, 4), rng=rng)
        ref = _first_stop(full, stops)
        if ref is None:
            assert stop is None and d.output_text == full
        else:
            i, s = ref
            assert stop == s, (trial, text, stops)
            assert d.output_text == full[: i + len(s) if include else i]
        assert "".join(deltas) == d.output_text, (trial, text, stops, include)


def test_streaming_holds_back_possible_stop_prefix(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    text = "hello STOQ world STOP tail"
    ids = [byte_ids[b] for b in text.encode()]
    d = _detok(tokenizer, stop=["STOP"])
    emitted = ""
    for tid in ids:
        stop = d.update([tid])
        emitted += d.get_next_output_text(finished=stop is not None, delta=True)
        if stop is None:
            # never more than len(text) - 3 chars out: the last 3 could still start "STOP"
            assert len(emitted) == max(len(d.output_text) - 3, 0)
            assert d.get_next_output_text(finished=False, delta=False) == d.output_text[:-3]
        else:
            break
    assert stop == "STOP"
    assert emitted == d.output_text == "hello STOQ world "
    assert d.get_next_output_text(finished=True, delta=False) == "hello STOQ world "


def test_no_hold_back_when_stop_kept_or_absent(tokenizer):
    ids = tokenizer.encode("abc def")
    for kw in ({}, {"stop": ["zzzz"], "include_stop_str_in_output": True}):
        d = _detok(tokenizer, **kw)
        d.update(ids)
        assert d.get_next_output_text(finished=False, delta=True) == "abc def"
        assert d.get_next_output_text(finished=False, delta=True) == ""


def test_stop_terminated_token_not_decoded(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("done 😀"), eos]
    d = _detok(tokenizer, skip_special_tokens=False)
    assert d.update(ids[:-1]) is None
    assert d.update(ids[-1:], stop_terminated=True) is None
    assert d.finished and d.output_token_ids == ids
    assert d.output_text == "done 😀" == tokenizer.decode(ids[:-1])
    assert d.get_next_output_text(finished=True, delta=True) == "done 😀"


def test_decode_token(tokenizer):
    d = _detok(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert d.decode_token(eos) == "<|im_end|>"
    for tid in tokenizer.encode("Hello world 日本"):
        assert d.decode_token(tid) == tokenizer.decode([tid])
        assert d.decode_token(tid) == d.decode_token(tid)
