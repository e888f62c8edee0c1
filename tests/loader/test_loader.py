"""load_model from HF folders: safetensors (single, sharded), PyTorch .bin (single, sharded), errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedrs.loader import LoadedModel, load_model, resolve_dtype, resolve_model_path
from tests.helpers import load_hf_model, logits_of, make_config, make_tiny_llama


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One set of weights saved four ways, plus HF's logits for a prompt."""
    root = tmp_path_factory.mktemp("ckpt")
    folders = {
        "safetensors": make_tiny_llama(root, "qwen2", subdir="st"),
        "safetensors-sharded": make_tiny_llama(root, "qwen2", subdir="st3", num_shards=3),
        "bin": make_tiny_llama(root, "qwen2", subdir="bin", weights_format="bin"),
        "bin-sharded": make_tiny_llama(root, "qwen2", subdir="bin3", weights_format="bin", num_shards=3),
    }
    ids = list(range(3, 40, 3))
    with torch.no_grad():
        ref = load_hf_model(folders["safetensors"])(torch.tensor([ids])).logits[0]
    return folders, ids, ref


@pytest.mark.parametrize("fmt", ["safetensors", "safetensors-sharded", "bin", "bin-sharded"])
def test_formats_load_same_weights(reference, fmt):
    folders, ids, ref = reference
    if fmt.endswith("sharded"):
        index = (
            "model.safetensors.index.json"
            if fmt.startswith("safetensors")
            else "pytorch_model.bin.index.json"
        )
        assert len(set(json.loads((folders[fmt] / index).read_text())["weight_map"].values())) > 1
    loaded = load_model(str(folders[fmt]))
    assert isinstance(loaded, LoadedModel)
    assert loaded.model_path == str(folders[fmt].resolve())
    assert loaded.hf_config.model_type == "qwen2"
    assert loaded.tokenizer.decode(loaded.tokenizer("héllo")["input_ids"]) == "héllo"
    torch.testing.assert_close(logits_of(loaded, ids), ref, atol=1e-4, rtol=1e-4)


def test_unknown_path(monkeypatch):
    with pytest.raises(ValueError, match="no/such/model-dir"):
        load_model("/no/such/model-dir")
    # a Hub name: offline here (the Hub's own errors are tested against a loopback Hub in test_hub_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not-a-local-org/not-a-model"):
        resolve_model_path("not-a-local-org/not-a-model")


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))
    make_config().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="has no weights"):
        load_model(str(tmp_path))


def test_unknown_architecture(tmp_path):
    path = make_tiny_llama(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*supported:.*LlamaForCausalLM"):
        load_model(str(path))


def _rewrite_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_llama(tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(path))


def test_missing_plain_tensor_is_named(tmp_path):
    path = make_tiny_llama(tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.norm\.weight"):
        load_model(str(path))


def test_wrong_shape_is_named(tmp_path):
    path = make_tiny_llama(tmp_path)

    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)

    _rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        load_model(str(path))


def test_unexpected_tensor_is_named(tmp_path):
    path = make_tiny_llama(tmp_path)

    def edit(t):
        t["model.layers.0.mystery.weight"] = torch.zeros(3)

    _rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mystery\.weight"):
        load_model(str(path))


def test_separate_tokenizer_and_dtype(tmp_path):
    model_dir = make_tiny_llama(tmp_path, tokenizer=False, subdir="m")
    tok_dir = make_tiny_llama(tmp_path, subdir="t")
    loaded = load_model(str(model_dir), tokenizer=str(tok_dir), dtype="float16")
    assert loaded.tokenizer.eos_token == "</s>"
    assert loaded.model.lm_head.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="tokenizer"):
        load_model(str(model_dir))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tok_dir), dtype="float8")


def test_resolve_dtype_auto():
    cfg = make_config()
    cfg.dtype = "bfloat16"
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    assert resolve_dtype(torch.float16, cfg, torch.device("cpu")) == torch.float16
    assert resolve_dtype("bf16", cfg, torch.device("cpu")) == torch.bfloat16
