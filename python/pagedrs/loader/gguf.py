"""GGUF files (llama.cpp): dequantized once into a cache folder that looks like an HF checkpoint
(config.json, model.safetensors in float32, tokenizer files), reused by every later load.

Config and tokenizer (chat template included) come from transformers' own GGUF readers
(`AutoConfig/AutoTokenizer.from_pretrained(dir, gguf_file=...)`); tensors are dequantized with the `gguf`
package, renamed to HF names, and the Q/K row permutation llama.cpp's converter applies to Llama
attention weights is undone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

__all__ = ["GGUF_ARCHITECTURES", "convert_gguf", "gguf_cache_dir", "cache_root"]

# general.architecture -> (HF architecture, whether llama.cpp permuted the Q/K rows)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

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
}
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


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor of the Llama family (None for tensors that have no HF counterpart)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary pairs -> HF's rotate-half layout)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _tensors(gguf_path: Path, num_heads: int, num_kv_heads: int) -> tuple[str, dict[str, object]]:
    import gguf
    import torch

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{gguf_path}: no general.architecture in the GGUF metadata")
    arch = str(field.contents())
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    permuted = GGUF_ARCHITECTURES[arch][1]
    tensors: dict[str, object] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            if t.name in _IGNORED:
                continue
            raise ValueError(f"{gguf_path}: GGUF tensor {t.name!r} has no HF counterpart")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and ".q_proj." in name:
            w = unpermute_qk(w, num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_qk(w, num_kv_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:  # F32/F16 tensors are views of the mmap
            w = np.array(w, dtype=np.float32, order="C")
        tensors[name] = torch.from_numpy(w)
    return arch, tensors


def convert_gguf(gguf_path: str | Path, root: str | Path | None = None) -> Path:
    """The HF-style cache folder for `gguf_path`, converting on first use. Safe against concurrent
    converters: each writes a private temp folder and renames it into place."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

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
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        arch, tensors = _tensors(gguf_path, num_heads, num_kv_heads)
        config.architectures = [GGUF_ARCHITECTURES[arch][0]]
        if "lm_head.weight" not in tensors:
            config.tie_word_embeddings = True
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
        config.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(str(tmp))
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
