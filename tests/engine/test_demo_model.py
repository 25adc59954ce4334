"""`kvfleet demo-model`: random-weight HF model directories that transformers and the engine both load."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvfleet_engine.demo_model import build_demo_model, count_parameters, main, make_config
from kvfleet_engine.demo_model import tokenizer as demo_tok
from kvfleet_engine.demo_model.checkpoint import parse_size, plan_shards, to_dtype_bytes
from kvfleet_engine.demo_model.presets import tensor_shapes

ARCHS = ["llama", "qwen2", "mistral"]
TEXTS = [
    "Hello world! The transformer architecture relies on attention.",
    "In 2024, 12345 cats'll run  fast!!\n\n\n   def f(x):\n        return x**2  # note\t end",
    "Grüße aus Köln — naïve café, 東京, emoji 🤗👍 and a zero-width\u200bjoiner.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "",
]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _safetensors_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            keys |= set(st.keys())
    return keys


def _load_np(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@contextlib.contextmanager
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead (and contention on small CI boxes)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_vocab_and_special_tokens():
    tok = demo_tok.build_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == demo_tok.VOCAB_SIZE == 4096
    assert tok.token_to_id("<|endoftext|>") == demo_tok.EOS_TOKEN_ID == 4093
    assert tok.token_to_id("<|im_start|>") == demo_tok.IM_START_TOKEN_ID == 4094
    assert tok.token_to_id("<|im_end|>") == demo_tok.IM_END_TOKEN_ID == 4095
    for text in TEXTS:
        enc = tok.encode(text)
        assert max(enc.ids, default=0) < 4096
        assert tok.decode(enc.ids, skip_special_tokens=False) == text  # byte-level: lossless
    assert tok.encode("Hello").ids[0] != demo_tok.EOS_TOKEN_ID  # no BOS prepended
    assert tok.encode("<|im_end|>").ids == [4095]
    # a real BPE: common words are single tokens, the corpus compresses well
    assert len(tok.encode(" the").ids) == 1
    corpus = (demo_tok.CORPUS_DIR / "nature.txt").read_text(encoding="utf-8")
    assert len(tok.encode(corpus).ids) < len(corpus.encode()) / 3


def test_tokenizer_training_is_deterministic_across_processes():
    here = hashlib.sha256(demo_tok.tokenizer_json_text().encode()).hexdigest()
    code = (
        "import hashlib; from kvfleet_engine.demo_model.tokenizer import tokenizer_json_text as t; "
        "print(hashlib.sha256(t().encode()).hexdigest())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_subprocess_env()
    )
    assert there.stdout.strip() == here


def _subprocess_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "common"), str(root / "engine"), env.get("PYTHONPATH", "")]
    )
    env["PYTHONHASHSEED"] = "12345"
    return env


# ------------------------------------------------------------------------------------- files and HF loading


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_model_tokenizer_and_chat_template(demo_model, arch):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = demo_model(arch=arch)
    names = set(_files(path))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names

    cfg = json.loads((path / "config.json").read_text())
    arch_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    assert cfg["architectures"] == [arch_class[arch]] and cfg["model_type"] == arch
    assert cfg["vocab_size"] == 4096 and cfg["head_dim"] == 16
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    if arch != "llama":
        assert cfg["sliding_window"] is None  # full attention
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [4093, 4095] and gen["pad_token_id"] == 4093

    hf_cfg = AutoConfig.from_pretrained(path)
    assert hf_cfg.rope_parameters["rope_theta"] == cfg["rope_theta"]
    assert getattr(hf_cfg, "sliding_window", None) is None
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == arch_class[arch]
    assert model.dtype == torch.float32
    assert model.num_parameters() == count_parameters(cfg)

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 4096
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 4093 and tok.pad_token_id == 4093
    assert tok.bos_token is None
    # HF (transformers 5 rebuilds qwen2's pre-tokenizer itself) tokenizes exactly like tokenizer.json
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        assert tok(text).input_ids == raw.encode(text).ids, text

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == raw.encode(text).ids and ids[0] == 4094 and ids.count(4095) == 2
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    ]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi there<|im_end|>\n"


def test_biases_qwen2_only(demo_model):
    qwen = _safetensors_keys(demo_model(arch="qwen2"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj}.bias" in qwen
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen
    for arch in ("llama", "mistral"):
        assert not [k for k in _safetensors_keys(demo_model(arch=arch)) if k.endswith(".bias")]


def test_tied_embeddings_qwen2_tiny_untied_llama_tiny(demo_model):
    from transformers import AutoModelForCausalLM

    qwen = demo_model(arch="qwen2")
    assert json.loads((qwen / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in _safetensors_keys(qwen)
    model = AutoModelForCausalLM.from_pretrained(qwen)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    llama = demo_model(arch="llama")
    assert json.loads((llama / "config.json").read_text())["tie_word_embeddings"] is False
    weights = _load_np(llama)
    assert "lm_head.weight" in weights
    assert not np.array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_tensor_shapes_match_the_hf_model(demo_model):
    from transformers import AutoModelForCausalLM

    for arch in ARCHS:
        path = demo_model(arch=arch)
        cfg = json.loads((path / "config.json").read_text())
        weights = _load_np(path)
        assert {k: v.shape for k, v in weights.items()} == tensor_shapes(cfg)
        hf = AutoModelForCausalLM.from_pretrained(path).state_dict()
        if cfg["tie_word_embeddings"]:
            hf.pop("lm_head.weight")
        assert {k: tuple(v.shape) for k, v in hf.items()} == tensor_shapes(cfg)


# ------------------------------------------------------------------------------- determinism and sharding


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = build_demo_model(tmp_path / "a", arch="qwen2", seed=0)
    b = build_demo_model(tmp_path / "b", arch="qwen2", seed=0)
    c = build_demo_model(tmp_path / "c", arch="qwen2", seed=1)
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert fa == fb
    assert fa["model.safetensors"] != fc["model.safetensors"]
    assert {k: v for k, v in fa.items() if k != "model.safetensors"} == {
        k: v for k, v in fc.items() if k != "model.safetensors"
    }
    wa, wc = _load_np(a), _load_np(c)
    assert all(not np.array_equal(wa[k], wc[k]) for k in wa)


def test_archs_get_independent_weights(demo_model):
    llama, mistral = _load_np(demo_model(arch="llama")), _load_np(demo_model(arch="mistral"))
    assert not np.array_equal(
        llama["model.layers.0.self_attn.q_proj.weight"], mistral["model.layers.0.self_attn.q_proj.weight"]
    )


def test_sharded_checkpoint_matches_hf_layout_and_values(demo_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    single = demo_model(arch="llama")
    sharded = build_demo_model(tmp_path / "sharded", arch="llama", shard_size=400_000)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    ref = _load_np(single)
    assert set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in ref.values())
    assert index["metadata"]["total_parameters"] == count_parameters(
        json.loads((single / "config.json").read_text())
    )
    for shard in shards:
        from safetensors.numpy import load_file

        part = load_file(str(sharded / shard))
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(part)
        # tensors that fit are packed up to the limit; only an oversized tensor exceeds it, alone
        assert sum(v.nbytes for v in part.values()) <= 400_000 or len(part) == 1
        for k, v in part.items():
            assert np.array_equal(v, ref[k]), k
    a = AutoModelForCausalLM.from_pretrained(single).state_dict()
    b = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # rebuilding unsharded into the same directory removes the shards
    build_demo_model(sharded, arch="llama")
    assert sorted(p.name for p in sharded.glob("model*")) == ["model.safetensors"]


def test_plan_shards_follows_hf():
    sizes = {"a": 6, "b": 6, "c": 2, "d": 6, "e": 2, "f": 2, "g": 20, "h": 1}
    assert plan_shards(sizes, 10) == [["a"], ["b", "c"], ["g"], ["d", "e", "f"], ["h"]]
    assert plan_shards(sizes, None) == [list(sizes)]


def test_parse_size():
    assert parse_size("50MB") == 50_000_000
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1000") == 1000 and parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("lots")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_is_rounded_float32_and_loads(demo_model, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 3
    x[:4] = [1.00390625, 1.01171875, -2.5e-3, 0.0]  # bf16 ties: round to even
    want = torch.from_numpy(x).to(getattr(torch, dtype)).view(torch.int16).numpy().tobytes()
    assert to_dtype_bytes(x, dtype) == want

    low = demo_model(arch="qwen2", dtype=dtype)
    assert json.loads((low / "config.json").read_text())["torch_dtype"] == dtype
    full = _load_np(demo_model(arch="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(low)
    assert model.dtype == getattr(torch, dtype)
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.bias", "model.norm.weight"):
        assert torch.equal(state[name], torch.from_numpy(full[name]).to(getattr(torch, dtype))), name


# --------------------------------------------------------------------------------- numerics of the weights


PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_varied_and_well_separated(demo_model, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model(arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about rivers."}], add_generation_prompt=True
    )
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    rand = np.random.default_rng(7).integers(0, 4093, size=30).tolist()
    prompts = [tok(p).input_ids for p in PROMPTS] + [list(chat), rand]
    gaps, stds, firsts = [], [], set()
    with _one_torch_thread(), torch.inference_mode():
        for ids in prompts:
            ids = list(ids)
            out = model(torch.tensor([ids]), use_cache=True)
            generated = []
            for _ in range(32):
                logits = out.logits[0, -1]
                top = logits.topk(2).values
                gaps.append(float(top[0] - top[1]))
                stds.append(float(logits.std()))
                nxt = int(logits.argmax())
                generated.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
            firsts.add(generated[0])
            assert len(set(generated)) >= 20, generated  # not a repeated token
            tail = generated[-12:]
            assert tail[0::2] != tail[1::2] or len(set(tail)) > 2, generated  # not a 1- or 2-cycle
    assert len(firsts) == len(prompts)  # the prompt matters
    gaps_a = np.array(gaps)
    assert 6 < np.mean(stds) < 10  # default logit_std 8
    assert gaps_a.min() > 2e-3, gaps_a.min()  # 10x the float32 error of these logits
    assert np.median(gaps_a) > 1.0


def test_logit_std_only_rescales(tmp_path, demo_model):
    import torch
    from transformers import AutoModelForCausalLM

    base = demo_model(arch="llama")
    big = build_demo_model(tmp_path / "big", arch="llama", logit_std=64.0)
    ids = torch.tensor([np.random.default_rng(3).integers(0, 4093, size=24).tolist()])
    with torch.inference_mode():
        a = AutoModelForCausalLM.from_pretrained(base)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(big)(ids).logits
    torch.testing.assert_close(b, a * 8, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------------------------- presets and the CLI


def test_parameter_counts():
    for arch in ARCHS:
        tiny = make_config(arch, "tiny")
        assert tiny["hidden_size"] <= 128 and tiny["num_hidden_layers"] == 4
        assert 0.4e6 < count_parameters(tiny) < 0.8e6
        small = make_config(arch, "small")
        assert 45e6 <= count_parameters(small) <= 55e6, count_parameters(small)
        bench = make_config(arch, "bench")
        assert bench["tie_word_embeddings"] and bench["vocab_size"] == 4096
        assert 0.36e9 <= count_parameters(bench) <= 0.40e9, count_parameters(bench)
        for cfg in (tiny, small, bench):  # the closed formula agrees with the tensor list
            shapes = tensor_shapes(cfg)
            assert count_parameters(cfg) == sum(int(np.prod(s)) for s in shapes.values())
    b = make_config("qwen2", "bench")
    assert (b["hidden_size"], b["num_hidden_layers"], b["num_attention_heads"], b["num_key_value_heads"]) == (
        896,
        24,
        14,
        2,
    )
    assert (b["head_dim"], b["intermediate_size"], b["rope_theta"]) == (64, 4864, 1e6)
    assert not make_config("llama", "small")["tie_word_embeddings"]
    assert make_config("qwen2", "small")["tie_word_embeddings"]


def test_cli(tmp_path, capsys):
    assert (
        main(["--out", str(tmp_path / "m"), "--arch", "mistral", "--seed", "3", "--shard-size", "1MB"]) == 0
    )
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "MistralForCausalLM" in line and "721,472 params" in line
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--arch", "gpt2"])
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--shard-size", "big"])
