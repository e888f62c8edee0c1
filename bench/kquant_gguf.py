r"""Real-shaped Q4_K_M GGUF files with random weights, for side-by-side runs (bench/cpu_peer.py) on the
block types the K-quant files people download carry.

    python bench/kquant_gguf.py --out /tmp/kquant                 # all families
    python bench/kquant_gguf.py --out /tmp/kquant --family qwen2.5-0.5b

Each file has a published model's shapes (layers, widths, heads, vocabulary) and the per-tensor types
llama.cpp's `llama-quantize ... Q4_K_M` gives it: Q4_K by default; Q6_K for the output matrix (the token
embedding where it is tied) and for attn_v / ffn_down on the layers its `use_more_bits` picks (the first
and last eighth, and every third between); then, where a row length is not a multiple of 256, its
fallback (Q4_K -> Q5_0, Q6_K -> Q8_0). So Qwen2.5-0.5B (hidden 896), Gemma 3 270M (640) and SmolLM2-360M
(960) are mostly Q5_0 with a Q8_0 embedding and Q4_K / Q6_K ffn_down, as their downloaded Q4_K_M files
are. Norms and biases are float32.

Weights are random blocks: random quant bytes with f16 scales sized so that each weight has an RMS of
about 0.02, so activations stay finite in both engines; the figures measure speed, not text. The
tokenizer is the embedded default model's (SmolLM2's byte-level BPE, 49152 entries) padded with normal
tokens `<extra_N>` to the family's vocabulary, which both llama-server and pagedrs load. For Gemma 3 the
two do not cut text alike: pagedrs's tokenizer for that file (a transformers `GemmaTokenizer`) makes
each space a token of its own, about 2.2x the tokens llama.cpp makes from the same words, so compare
prompt tokens per second there, not TTFT.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Family:
    arch: str  # GGUF general.architecture
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float
    qkv_bias: bool = False
    sliding_window: int = 0


FAMILIES = {
    "qwen2.5-0.5b": Family("qwen2", 24, 896, 4864, 14, 2, 64, 151936, 1e6, 1e-6, qkv_bias=True),
    "gemma3-270m": Family("gemma3", 18, 640, 2048, 4, 1, 256, 262144, 1e6, 1e-6, sliding_window=512),
    "smollm2-360m": Family("llama", 32, 960, 2560, 15, 5, 64, 49152, 1e5, 1e-5),
}

# RMS of one block's quant values before scaling (random bytes), per type: the f16 scale is 0.02 / this.
# Q4_K / Q5_K: the 6-bit sub-scale (0..63) times the 4/5-bit value; Q6_K: the int8 sub-scale times q-32.
_VALUE_RMS = {Q.Q4_K: 320.0, Q.Q6_K: 1400.0, Q.Q5_0: 9.2, Q.Q8_0: 74.0}
_SCALE_AT = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,)}  # f16 fields (llama.cpp's structs)
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama.cpp's when a row is not a multiple of 256


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get Q6_K attn_v / ffn_down in a Q4_K_M file."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def q4_k_m_type(name: str, cols: int, i_layer: int, n_layers: int, tied: bool) -> Q:
    """The type `llama-quantize` gives tensor `name` (row length `cols`) in a Q4_K_M file."""
    qtype = Q.Q4_K
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = Q.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(i_layer, n_layers):
        qtype = Q.Q6_K
    if cols % 256:
        qtype = _FALLBACK[qtype]
    return qtype


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quant bytes, f16 scales of either sign giving weights of RMS ~0.02."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale = 0.02 / _VALUE_RMS[qtype]
    for at in _SCALE_AT[qtype]:
        d = (rng.uniform(0.5, 1.5, len(data)) * scale * rng.choice([-1, 1], len(data))).astype(np.float16)
        if qtype == Q.Q4_K and at == 2:
            d = np.abs(d) * np.float16(0.25)  # dmin: a small positive offset, as the quantizer gives
        data[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, cols // block * size)


def _tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """The embedded default model's tokenizer, its token list padded to `vocab` with normal tokens."""
    from pagedrs.loader.default_model import default_model_path
    from pagedrs.loader.gguf_reader import field_value, open_gguf

    r = open_gguf(default_model_path())
    tokens = list(field_value(r, "tokenizer.ggml.tokens"))
    types = list(field_value(r, "tokenizer.ggml.token_type"))
    if vocab < len(tokens):
        raise ValueError(f"vocabulary {vocab} is smaller than the default tokenizer's {len(tokens)}")
    tokens += [f"<extra_{i}>" for i in range(len(tokens), vocab)]
    types += [int(gguf.TokenType.NORMAL)] * (vocab - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(field_value(r, "tokenizer.ggml.pre")))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(field_value(r, "tokenizer.ggml.merges")))
    for key, add in (
        ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
        ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
    ):
        add(int(field_value(r, key)))
    w.add_add_bos_token(False)


def _metadata(w: gguf.GGUFWriter, f: Family) -> None:
    w.add_block_count(f.layers)
    w.add_context_length(32768)
    w.add_embedding_length(f.hidden)
    w.add_feed_forward_length(f.intermediate)
    w.add_head_count(f.heads)
    w.add_head_count_kv(f.kv_heads)
    w.add_key_length(f.head_dim)
    w.add_value_length(f.head_dim)
    w.add_rope_dimension_count(f.head_dim)
    w.add_rope_freq_base(f.rope_theta)
    w.add_layer_norm_rms_eps(f.eps)
    w.add_vocab_size(f.vocab)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    if f.sliding_window:
        w.add_sliding_window(f.sliding_window)


def _tensors(f: Family) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape [out, in] or [n]) of every tensor; the embedding is tied (no output.weight)."""
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (f.vocab, f.hidden))]
    gemma = f.arch == "gemma3"
    for i in range(f.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (f.hidden,)), (b + "ffn_norm.weight", (f.hidden,))]
        out += [(b + "attn_q.weight", (q, f.hidden)), (b + "attn_k.weight", (kv, f.hidden))]
        out += [(b + "attn_v.weight", (kv, f.hidden)), (b + "attn_output.weight", (f.hidden, q))]
        out += [(b + "ffn_gate.weight", (f.intermediate, f.hidden))]
        out += [(b + "ffn_up.weight", (f.intermediate, f.hidden))]
        out += [(b + "ffn_down.weight", (f.hidden, f.intermediate))]
        if f.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if gemma:
            out += [(b + "attn_q_norm.weight", (f.head_dim,)), (b + "attn_k_norm.weight", (f.head_dim,))]
            out += [
                (b + "post_attention_norm.weight", (f.hidden,)),
                (b + "post_ffw_norm.weight", (f.hidden,)),
            ]
    out.append(("output_norm.weight", (f.hidden,)))
    return out


def write_family(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Write `<out_dir>/<name>-Q4_K_M-random.gguf`; returns its path."""
    f = FAMILIES[name]
    rng = np.random.default_rng(seed)
    path = out_dir / f"{name}-Q4_K_M-random.gguf"
    w = gguf.GGUFWriter(str(path), f.arch)
    w.add_name(f"{name} (random weights, Q4_K_M types)")
    _metadata(w, f)
    _tokenizer(w, f.vocab)
    for tname, shape in _tensors(f):
        if len(shape) == 1:
            # norms: 1 (Gemma's GGUF files store 1 + w, so 1.0 is w = 0); biases: small
            vec = np.ones(shape, np.float32) if tname.endswith("norm.weight") else rng.normal(0, 0.02, shape)
            w.add_tensor(tname, np.asarray(vec, dtype=np.float32))
            continue
        rows, cols = shape
        i_layer = int(tname.split(".")[1]) if tname.startswith("blk.") else 0
        qtype = q4_k_m_type(tname, cols, i_layer, f.layers, tied=True)
        data = random_blocks(qtype, rows, cols, rng)
        w.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def type_counts(path: Path) -> dict[str, int]:
    """Bytes per GGML type of a GGUF file's tensors."""
    from pagedrs.loader.gguf_reader import open_gguf

    counts: dict[str, int] = {}
    for t in open_gguf(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kquant", help="folder for the .gguf files (not the repository)")
    p.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: all")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.family or sorted(FAMILIES):
        path = write_family(name, out, args.seed)
        mib = {k: round(v / 2**20, 1) for k, v in sorted(type_counts(path).items())}
        print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB; MiB per type {mib}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
