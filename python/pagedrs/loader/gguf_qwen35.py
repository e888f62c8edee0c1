"""Qwen3.5 / Qwen3.6 GGUF files (`qwen35`, `qwen35moe`) as llama.cpp's converter writes them, read back into
HF's Qwen3_5(Moe)ForCausalLM names, values and config.

What the converter does, undone here:
- names: the Gated DeltaNet projections are `attn_qkv` (in_proj_qkv), `attn_gate` (in_proj_z), `ssm_beta` /
  `ssm_alpha` (in_proj_b / in_proj_a), `ssm_conv1d`, `ssm_norm`, `ssm_out`; `ssm_a` (no suffix) holds
  -exp(A_log) and `ssm_dt.bias` the dt_bias; the norm after attention is `post_attention_norm`;
- values: the zero-centred RMSNorm weights (all but the gated `ssm_norm`) are stored with 1 added; the conv1d
  weight [channels, 1, kernel] is squeezed to [channels, kernel];
- order: with fewer key heads than value heads, the value heads are reordered from grouped by key head
  ([k0: v0..v{r-1}, k1: ...], HF) to tiled ([v0 of k0, v0 of k1, ...]) in every tensor that has them (the
  V rows of in_proj_qkv and conv1d, in_proj_z / a / b, A_log, dt_bias, and out_proj's columns);
- the layer pattern is `full_attention_interval` (every n-th layer full attention); the multi-token
  prediction layers appended after the last block (`nextn_predict_layers`) are not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedrs.loader.gguf_moe import MOE_BLOCK_NAMES
from pagedrs.loader.gguf_reader import field_value as _field

if TYPE_CHECKING:
    import transformers
    from gguf import GGUFReader

    from pagedrs.quantization.gguf_blocks import GGUFWeight

__all__ = ["QWEN35_ARCHS", "QWEN35_BLOCK_NAMES", "Qwen35Layout", "qwen35_config", "qwen35_tensor_name"]

QWEN35_ARCHS = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
QWEN35_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **MOE_BLOCK_NAMES,
}
# tensors llama.cpp names without a .weight/.bias suffix, or whose suffix changes meaning
_SPECIAL = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}


def qwen35_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a per-layer `qwen35` / `qwen35moe` tensor (`blk.N.…`), None for any other name."""
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    rest = parts[2]
    if rest in _SPECIAL:
        return f"model.layers.{parts[1]}.{_SPECIAL[rest]}"
    base, _, suffix = rest.rpartition(".")
    if suffix in ("weight", "bias") and base in QWEN35_BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{QWEN35_BLOCK_NAMES[base]}.{suffix}"
    return None


def _required(reader: GGUFReader, arch: str, key: str) -> Any:
    value = _field(reader, f"{arch}.{key}")
    if value is None:
        raise ValueError(f"{arch} GGUF file has no {arch}.{key} in its metadata")
    return value


@dataclass(frozen=True)
class Qwen35Layout:
    """The linear-attention head layout of a `qwen35` / `qwen35moe` file and how many blocks are the model's
    own (the rest are multi-token-prediction layers)."""

    num_layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def from_reader(cls, reader: GGUFReader, arch: str) -> Qwen35Layout:
        value_heads = int(_required(reader, arch, "ssm.time_step_rank"))
        return cls(
            num_layers=int(_required(reader, arch, "block_count"))
            - int(_field(reader, f"{arch}.nextn_predict_layers") or 0),
            key_heads=int(_required(reader, arch, "ssm.group_count")),
            value_heads=value_heads,
            key_dim=int(_required(reader, arch, "ssm.state_size")),
            value_dim=int(_required(reader, arch, "ssm.inner_size")) // value_heads,
        )

    def is_model_layer(self, gguf_name: str) -> bool:
        """False for the tensors of the appended multi-token-prediction blocks."""
        parts = gguf_name.split(".", 2)
        return not (parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= self.num_layers)

    def _grouped(self, head_dim: int) -> np.ndarray:
        """Index i of HF's (grouped) order -> its row in llama.cpp's tiled order, for value heads of
        `head_dim` rows each."""
        r = self.value_heads // self.key_heads
        n = self.value_heads * head_dim
        tiled = np.arange(n).reshape(self.key_heads, r, head_dim).swapaxes(0, 1).reshape(n)
        return np.argsort(tiled)

    def row_order(self, hf_name: str, rows: int) -> np.ndarray | None:
        """The row permutation (HF row i = file row order[i]) undoing the value-head reorder, or None."""
        if self.key_heads == self.value_heads or ".linear_attn." not in hf_name:
            return None
        if hf_name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
            qk = 2 * self.key_heads * self.key_dim
            return np.concatenate([np.arange(qk), qk + self._grouped(self.value_dim)])
        if hf_name.endswith(".in_proj_z.weight"):
            return self._grouped(self.value_dim)
        if hf_name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
            return self._grouped(1)
        return None

    def col_order(self, hf_name: str) -> np.ndarray | None:
        """The column permutation of out_proj undoing the value-head reorder, or None."""
        if self.key_heads == self.value_heads or not hf_name.endswith(".linear_attn.out_proj.weight"):
            return None
        return self._grouped(self.value_dim)

    def dense(self, hf_name: str, w: np.ndarray) -> np.ndarray:
        """A float32 tensor of the file as HF holds it (values, shape and order)."""
        if hf_name.endswith("norm.weight") and not hf_name.endswith(".linear_attn.norm.weight"):
            w = np.subtract(w, 1.0, dtype=np.float32)
        elif hf_name.endswith(".A_log"):
            w = np.log(-w.astype(np.float32))
        order = self.row_order(hf_name, w.shape[0])
        if order is not None:
            w = w[order]
        cols = self.col_order(hf_name)
        if cols is not None:
            w = w[:, cols]
        if hf_name.endswith(".conv1d.weight"):
            w = w.reshape(w.shape[0], 1, w.shape[-1])
        return w

    def quantized(self, hf_name: str, q: GGUFWeight) -> GGUFWeight | None:
        """A block-quantized matrix with the value-head reorder undone (rows exactly; columns by moving whole
        blocks), or None when the columns would have to be cut inside a block (load it dequantized)."""
        order = self.row_order(hf_name, q.shape[0])
        if order is not None:
            q = q.permute_rows(order)
        cols = self.col_order(hf_name)
        if cols is None:
            return q
        if self.value_dim % q.block_size:
            return None
        heads = cols.reshape(-1, self.value_dim)[:, 0] // self.value_dim
        per_head = self.value_dim // q.block_size
        blocks = (heads[:, None] * per_head + np.arange(per_head)).reshape(-1)
        rows = q.data.shape[0]
        data = q.data.reshape(rows, len(blocks), -1)[:, blocks].reshape(rows, -1)
        return type(q)(q.ggml_type, q.shape, np.ascontiguousarray(data))


def qwen35_config(reader: GGUFReader, arch: str) -> transformers.PretrainedConfig:
    """HF's Qwen3_5TextConfig / Qwen3_5MoeTextConfig from a `qwen35` / `qwen35moe` file's metadata."""
    import transformers

    layout = Qwen35Layout.from_reader(reader, arch)
    heads = int(_required(reader, arch, "attention.head_count"))
    hidden = int(_required(reader, arch, "embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
    rotary = int(_field(reader, f"{arch}.rope.dimension_count") or head_dim // 4)
    interval = int(_field(reader, f"{arch}.full_attention_interval") or 4)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    kw: dict[str, Any] = dict(
        vocab_size=int(embd.shape[1]),  # GGUF lists the fastest-varying dim first
        hidden_size=hidden,
        num_hidden_layers=layout.num_layers,
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layout.num_layers)
        ],
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        linear_key_head_dim=layout.key_dim,
        linear_value_head_dim=layout.value_dim,
        linear_num_key_heads=layout.key_heads,
        linear_num_value_heads=layout.value_heads,
        linear_conv_kernel_dim=int(_required(reader, arch, "ssm.conv_kernel")),
        max_position_embeddings=int(_required(reader, arch, "context_length")),
        rms_norm_eps=float(_required(reader, arch, "attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
            "partial_rotary_factor": rotary / head_dim,
        },
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
    )
    if arch == "qwen35":
        config: Any = transformers.Qwen3_5TextConfig(
            intermediate_size=int(_required(reader, arch, "feed_forward_length")), **kw
        )
    else:
        config = transformers.Qwen3_5MoeTextConfig(
            num_experts=int(_required(reader, arch, "expert_count")),
            num_experts_per_tok=int(_required(reader, arch, "expert_used_count")),
            moe_intermediate_size=int(_required(reader, arch, "expert_feed_forward_length")),
            shared_expert_intermediate_size=int(
                _field(reader, f"{arch}.expert_shared_feed_forward_length") or 0
            ),
            **kw,
        )
    config.architectures = [QWEN35_ARCHS[arch]]
    return config
