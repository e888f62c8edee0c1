"""Tiny random mixture-of-experts configs (Mixtral, Qwen2-MoE, Qwen3-MoE), shared by the MoE model, layer
and engine tests; write one out with `tests.helpers.make_tiny_model(folder, config)`. Router weights are
drawn like every other weight (std 0.2, see make_tiny_model), large enough that every expert is chosen
by some token of a few prompts (`expert_usage` checks it)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import transformers

from pagedrs.layers.moe import SparseMoeBlock
from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tiny_model

_COMMON: dict[str, object] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)


def mixtral_config(**overrides: object) -> transformers.MixtralConfig:
    kwargs: dict[str, object] = dict(
        _COMMON, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2
    )
    return transformers.MixtralConfig(**{**kwargs, **overrides})


def qwen2_moe_config(**overrides: object) -> transformers.Qwen2MoeConfig:
    kwargs: dict[str, object] = dict(
        _COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    return transformers.Qwen2MoeConfig(**{**kwargs, **overrides})


def qwen3_moe_config(**overrides: object) -> transformers.Qwen3MoeConfig:
    kwargs: dict[str, object] = dict(
        _COMMON,
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    return transformers.Qwen3MoeConfig(**{**kwargs, **overrides})


MOE_CONFIGS = {
    "mixtral": mixtral_config,
    "mixtral-window": lambda: mixtral_config(sliding_window=6),
    "qwen2_moe": qwen2_moe_config,
    "qwen3_moe": qwen3_moe_config,
    "qwen3_moe-sparse-step": lambda: qwen3_moe_config(decoder_sparse_step=2, mlp_only_layers=[]),
}


def expert_usage(model: torch.nn.Module, prompts: list[list[int]]) -> list[Counter[int]]:
    """Per sparse layer, how many (token, slot) pairs each expert took over plain forwards of `prompts`."""
    from pagedrs.layers.attention import ForwardContext

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    counts: list[Counter[int]] = [Counter() for _ in blocks]

    def hook(i: int):
        def record(module: torch.nn.Module, args: tuple, out: object) -> None:
            from pagedrs.layers.moe import route

            _, ids = route(module.gate(args[0]), module.routing)
            counts[i].update(ids.reshape(-1).tolist())

        return record

    handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for p in prompts:
                model(torch.tensor(p), torch.arange(len(p)), ForwardContext(None, []))
    finally:
        for h in handles:
            h.remove()
    return counts


def write_stacked_checkpoint(folder: Path) -> None:
    """Rewrite `folder`'s per-expert tensors as transformers >= 5 holds them in memory: `experts.gate_up_proj`
    [E, 2I, H] (gate rows then up rows) and `experts.down_proj` [E, H, I], under `mlp`."""
    import re

    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    pat = re.compile(r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = pat.match(name)
        if m is None:
            out[name] = t
            continue
        kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(m.group(3), "down")
        experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[kind] = t
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in ids]
        ).contiguous()
        out[f"{prefix}.experts.down_proj"] = torch.stack([by_expert[e]["down"] for e in ids]).contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


# ---- GGUF files as llama.cpp writes MoE models ---------------------------------------------------------
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def gguf_moe_config(kind: str, **overrides: object) -> transformers.PretrainedConfig:
    """A config llama.cpp can express: every layer sparse, sizes on whole 32-weight blocks."""
    if kind == "mixtral":
        return mixtral_config(**overrides)
    if kind == "qwen2_moe":
        return qwen2_moe_config(**{"shared_expert_intermediate_size": 64, **overrides})
    return qwen3_moe_config(**{"mlp_only_layers": [], "num_hidden_layers": 2, **overrides})


def make_tiny_moe_gguf(tmp_path: Path, kind: str, qtype: str = "Q8_0", **overrides: object) -> Path:
    """A tiny random MoE model written as llama.cpp writes it: experts stacked per projection
    (`ffn_{gate,up,down}_exps` [E, rows, cols]), Q/K rows permuted for `llama`, matrices in `qtype`."""
    import gguf
    import numpy as np

    from tests.helpers import CHAT_TEMPLATE, make_tokenizer

    folder = make_tiny_model(tmp_path / f"{kind}-gguf-src", gguf_moe_config(kind, **overrides))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg, arch = hf.config, GGUF_ARCH[kind]
    out = tmp_path / f"tiny-{kind}.gguf"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if kind != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tok = make_tokenizer()
    tokens = [f"<extra_{i}>" for i in range(cfg.vocab_size)]
    for t, i in tok.get_vocab().items():
        tokens[i] = t
    tokens[259] = "ab"  # transformers' GGUF reader wants at least one merge
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (cfg.vocab_size - 256))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        # llama.cpp keeps the routers (ffn_gate_inp) in float32 whatever the file type
        if a.ndim >= 2 and qtype != "F32" and "ffn_gate_inp" not in name:
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, a)

    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    inter = cfg.intermediate_size if kind == "mixtral" else cfg.moe_intermediate_size
    for name, tensor in hf.state_dict().items():
        a = tensor.numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        elif name == "lm_head.weight":
            add("output.weight", a)
        else:
            parts = name.split(".")
            blk, module = parts[2], ".".join(parts[3:-1])
            if name.endswith("experts.gate_up_proj"):
                add(f"blk.{blk}.ffn_gate_exps.weight", a[:, :inter])
                add(f"blk.{blk}.ffn_up_exps.weight", a[:, inter:])
            elif name.endswith("experts.down_proj"):
                add(f"blk.{blk}.ffn_down_exps.weight", a)
            else:
                if arch == "llama" and module in heads:  # llama.cpp's permute
                    n = heads[module]
                    a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
                add(f"blk.{blk}.{_GGUF_LAYER[module]}.{parts[-1]}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
