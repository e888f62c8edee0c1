"""GGUF files (llama.cpp): converted once into a cache folder that looks like an HF checkpoint
(config.json, model.safetensors in float32, tokenizer files), reused by every later load.

Two ways to load the weights: the cache folder's float32 tensors (the dequantized oracle, and the path for
GPUs and explicit dtypes), or `iter_gguf_weights`, straight from the GGUF file with the quantized tensors
kept in their block layout (`GGUFWeight`) for the CPU kernels (each tensor-parallel rank cuts its shard).

Config and tokenizer (chat template included) come from transformers' own GGUF readers
(`AutoConfig/AutoTokenizer.from_pretrained(dir, gguf_file=...)`; gpt-oss's config from its metadata,
`gguf_gpt_oss`); tensors are dequantized with the `gguf` package, renamed to HF names, and the Q/K row
permutation llama.cpp's converter applies to Llama attention weights is undone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedrs.loader.gguf_gemma4 import gemma4_add_bos, gemma4_config, gemma4_tensor_name
from pagedrs.loader.gguf_gpt_oss import (
    GPT_OSS_BLOCK_NAMES,
    check_gpt_oss_tensors,
    gpt_oss_config,
    gpt_oss_weights,
)
from pagedrs.loader.gguf_moe import (
    MOE_BLOCK_NAMES,
    apply_moe_metadata,
    expert_pieces,
    is_stacked_experts,
    split_dense,
)
from pagedrs.loader.gguf_qwen35 import QWEN35_ARCHS, Qwen35Layout, qwen35_config, qwen35_tensor_name
from pagedrs.loader.gguf_reader import field_value as _field
from pagedrs.loader.gguf_reader import open_gguf

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor

    from pagedrs.quantization.gguf_blocks import GGUFWeight

__all__ = [
    "GGUF_ARCHITECTURES",
    "cache_root",
    "convert_gguf",
    "gguf_cache_dir",
    "head_counts",
    "iter_gguf_weights",
]

logger = logging.getLogger("pagedrs.loader")

# general.architecture -> (HF architecture, whether llama.cpp permuted the Q/K rows)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "gpt-oss": ("GptOssForCausalLM", False),
    "gemma4": ("Gemma4ForCausalLM", False),
    **{arch: (hf, False) for arch, hf in QWEN35_ARCHS.items()},
}
# architectures whose config is read from the metadata here (transformers' GGUF reader has none for them)
_OWN_CONFIG = {"gpt-oss", "gemma4", *QWEN35_ARCHS}
# llama.cpp's converter stores Gemma's (1 + w) norm weights with the 1 added: loading subtracts it
_NORM_PLUS_ONE = {"gemma2", "gemma3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **MOE_BLOCK_NAMES,
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before the MLP, not after attention
_ARCH_BLOCK_NAMES = {
    arch: {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"} for arch in ("gemma2", "gemma3")
}
_ARCH_BLOCK_NAMES["gpt-oss"] = {**_BLOCK_NAMES, **GPT_OSS_BLOCK_NAMES}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_IGNORED = {"rope_freqs.weight"}  # llama3 rope factors: the config carries the scaling
_FORMAT_VERSION = 1  # bump when the cache layout changes


def cache_root() -> Path:
    """`$PAGEDRS_CACHE`, else ~/.cache/pagedrs."""
    env = os.environ.get("PAGEDRS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedrs"


def gguf_cache_dir(gguf_path: str | Path, root: str | Path | None = None) -> Path:
    """The cache folder of one GGUF file, keyed on its absolute path, size and modification time."""
    path = Path(gguf_path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(root or cache_root()) / "gguf" / f"{path.stem}-{digest}"


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name of a GGUF tensor of architecture `arch` (None for tensors that have no HF counterpart)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if arch in QWEN35_ARCHS:
        return qwen35_tensor_name(gguf_name)
    if arch == "gemma4":
        return gemma4_tensor_name(gguf_name)
    m = _BLOCK_RE.match(gguf_name)
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary pairs -> HF's rotate-half layout)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def head_counts(config: Any) -> tuple[int, int]:
    """(attention heads, KV heads) of `config`, read from its dict: a per-layer config (Gemma 4's) refuses
    the attribute."""
    d = config.to_dict()
    heads = int(d["num_attention_heads"])
    return heads, int(d.get("num_key_value_heads") or heads)


def _open(gguf_path: Path) -> tuple[GGUFReader, str]:
    """(GGUFReader, architecture); ValueError for an architecture pagedrs has no model for."""
    reader = open_gguf(gguf_path)
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{gguf_path}: no general.architecture in the GGUF metadata")
    arch = str(field.contents())
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return reader, arch


def _qk_heads(name: str, arch: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count whose rotary row permutation llama.cpp applied to this tensor (None: not permuted)."""
    if not GGUF_ARCHITECTURES[arch][1]:
        return None
    if ".q_proj." in name:
        return num_heads
    if ".k_proj." in name:
        return num_kv_heads
    return None


def _tensors(gguf_path: Path, num_heads: int, num_kv_heads: int) -> tuple[str, dict[str, torch.Tensor]]:
    import gguf
    import torch

    reader, arch = _open(gguf_path)
    layout = _layout(reader, arch)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in _named(gguf_path, reader, arch, layout):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        heads = _qk_heads(name, arch, num_heads, num_kv_heads)
        if heads is not None:
            w = unpermute_qk(w, heads)
        w = _unshift_norm(w, name, arch) if layout is None else layout.dense(name, w)
        if not w.flags.writeable or not w.flags.c_contiguous:  # F32/F16 tensors are views of the mmap
            w = np.array(w, dtype=np.float32, order="C")
        for piece, a in split_dense(name, w):
            tensors[piece] = torch.from_numpy(a)
    if arch == "gpt-oss":
        tensors = dict(gpt_oss_weights(tensors.items()))
    return arch, tensors


def _unshift_norm(w: np.ndarray, name: str, arch: str) -> np.ndarray:
    """A Gemma norm weight back to HF's offset from 1 (llama.cpp wrote w + 1; HF's GGUF loader subtracts
    it the same way)."""
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        return np.subtract(w, 1.0, dtype=np.float32)
    return w


def _layout(reader: GGUFReader, arch: str) -> Qwen35Layout | None:
    """The value-head layout of a Qwen3.5 file (None for the other architectures)."""
    return Qwen35Layout.from_reader(reader, arch) if arch in QWEN35_ARCHS else None


def _named(
    gguf_path: Path, reader: GGUFReader, arch: str, layout: Qwen35Layout | None = None
) -> Iterator[tuple[str, ReaderTensor]]:
    """(HF name, ReaderTensor) of every GGUF tensor that has one; ValueError for an unknown tensor (or, for
    gpt-oss, a missing one). A Qwen3.5 file's multi-token-prediction blocks are left out."""
    if arch == "gpt-oss":
        check_gpt_oss_tensors(gguf_path, reader)
    for t in reader.tensors:
        if layout is not None and not layout.is_model_layer(t.name):
            continue
        name = hf_tensor_name(t.name, arch)
        if name is None:
            if t.name in _IGNORED:
                continue
            raise ValueError(f"{gguf_path}: GGUF tensor {t.name!r} has no HF counterpart")
        yield name, t


def iter_gguf_weights(
    gguf_path: str | Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF name, tensor) of a GGUF file, straight from its memory map: 2-D tensors of a type the CPU
    kernels take stay quantized (`GGUFWeight`, rows unpermuted where llama.cpp permuted Q/K); every
    other tensor is float32 (dequantized, with one log line per type that had to be)."""
    path = Path(gguf_path)
    reader, arch = _open(path)
    weights = _file_weights(path, reader, arch, num_heads, num_kv_heads)
    return gpt_oss_weights(weights) if arch == "gpt-oss" else weights


def _file_weights(
    path: Path, reader: GGUFReader, arch: str, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    import gguf
    import torch

    from pagedrs.quantization.gguf_blocks import GGUFWeight, kernel_types

    layout = _layout(reader, arch)
    dequantized: Counter[str] = Counter()
    for name, t in _named(path, reader, arch, layout):
        ggml_type = int(t.tensor_type)
        heads = _qk_heads(name, arch, num_heads, num_kv_heads)
        dense_type = ggml_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        if len(t.shape) == 2 and ggml_type in kernel_types():
            cols, rows = (int(d) for d in t.shape)  # GGUF lists the fastest-varying dim first
            q = GGUFWeight(ggml_type, (rows, cols), np.asarray(t.data, dtype=np.uint8))
            if heads is not None:
                q = q.permute_rows(unpermute_qk(np.arange(rows), heads))
            kept = q if layout is None else layout.quantized(name, q)
            if kept is not None:
                yield name, kept
                continue
        if len(t.shape) == 3 and ggml_type in kernel_types() and is_stacked_experts(name):
            cols, rows = int(t.shape[0]), int(t.shape[1])
            for piece, data in expert_pieces(name, np.asarray(t.data, dtype=np.uint8)):
                yield piece, GGUFWeight(ggml_type, (rows, cols), data)
            continue
        if not dense_type:
            dequantized[gguf.GGMLQuantizationType(ggml_type).name] += 1
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if heads is not None:
            w = unpermute_qk(w, heads)
        w = _unshift_norm(w, name, arch) if layout is None else layout.dense(name, w)
        for piece, a in split_dense(name, w):
            yield piece, torch.from_numpy(np.array(a, dtype=np.float32, order="C"))
    for type_name, count in sorted(dequantized.items()):
        logger.info(
            "%s: %d tensor(s) of type %s have no quantized CPU kernel; loaded dequantized to float32",
            path.name,
            count,
            type_name,
        )


def _apply_metadata(config: Any, reader: GGUFReader, arch: str) -> None:
    """Settings llama.cpp's converter writes that transformers' GGUF config reader leaves at their defaults:
    the head size (`attention.key_length`, Qwen3 and Gemma), Gemma 2's soft caps, and Gemma 3's linear
    RoPE scaling of the global layers (the 4B+ checkpoints)."""
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        config.head_dim = int(head_dim)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = _field(reader, f"{arch}.{key}")
            if value is not None:
                setattr(config, key, float(value))
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    params = getattr(config, "rope_parameters", None)
    if arch == "gemma3" and scaling == "linear" and factor and isinstance(params, dict):
        params.setdefault("full_attention", {}).update(rope_type="linear", factor=float(factor))


def convert_gguf(gguf_path: str | Path, root: str | Path | None = None) -> Path:
    """The HF-style cache folder for `gguf_path`, converting on first use. Safe against concurrent
    converters: each writes a private temp folder and renames it into place."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    gguf_path = Path(gguf_path).resolve()
    out = gguf_cache_dir(gguf_path, root)
    if (out / "pagedrs_gguf.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        folder, fname = str(gguf_path.parent), gguf_path.name
        reader, arch = _open(gguf_path)
        config: Any
        if arch == "gpt-oss":  # transformers' GGUF config reader fails on its rope keys
            config = gpt_oss_config(reader, gguf_path)
        elif arch in QWEN35_ARCHS:  # transformers' GGUF config reader has no Qwen3.5
            config = qwen35_config(reader, arch)
        elif arch == "gemma4":
            config = gemma4_config(reader)
        else:
            config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        arch, tensors = _tensors(gguf_path, *head_counts(config))
        config.architectures = [GGUF_ARCHITECTURES[arch][0]]
        if arch not in _OWN_CONFIG:
            _apply_metadata(config, reader, arch)
            config = apply_moe_metadata(config, reader, arch)
        if "lm_head.weight" not in tensors:
            config.tie_word_embeddings = True
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        # AutoTokenizer reads the GGUF config too; the tokenizer itself is read the same way either way
        tokenizer_cls = PreTrainedTokenizerFast if arch in _OWN_CONFIG else AutoTokenizer
        tokenizer = tokenizer_cls.from_pretrained(folder, gguf_file=fname)
        if arch == "gemma4":
            gemma4_add_bos(tokenizer, reader)
        tokenizer.save_pretrained(str(tmp))
        marker = {"source": str(gguf_path), "architecture": arch, "format_version": _FORMAT_VERSION}
        (tmp / "pagedrs_gguf.json").write_text(json.dumps(marker, indent=2))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "pagedrs_gguf.json").is_file():  # a stale, unfinished folder: replace it
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
