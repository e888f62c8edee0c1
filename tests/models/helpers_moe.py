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
from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

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
