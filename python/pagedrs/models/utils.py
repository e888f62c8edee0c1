"""Shared by the model classes: weight loading (HF tensor names -> parameters, fused shards included,
with every parameter checked to be covered and every shape checked) and the head size of MHA configs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from pagedrs.layers.linear import Loaded, default_weight_loader

__all__ = ["StackedParam", "check_tensor_parallel", "load_weights_into", "mha_head_size"]


def mha_head_size(config: PretrainedConfig) -> int:
    """hidden_size / num_attention_heads, for models whose heads exactly split the hidden size."""
    hidden, num_heads = config.hidden_size, config.num_attention_heads
    if hidden % num_heads:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({num_heads})")
    return hidden // num_heads


def check_tensor_parallel(config: PretrainedConfig, tp_size: int) -> None:
    """Can `config`'s heads be split over `tp_size` ranks? ValueError naming both numbers if not.

    Query heads must divide evenly. KV heads are split when there are at least as many as ranks
    (and must divide evenly), and replicated when there are fewer (the rank count must then be a
    multiple of them: Llama-3's 8 KV heads at TP 16 put each head on 2 ranks). A config with per-layer
    attention (Gemma 4's global layers: `per_layer_config`) is checked for each layer's KV heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    try:
        counts = {int(getattr(text, "num_key_value_heads", None) or heads)}
    except RuntimeError:  # transformers refuses the global value of an attribute that varies per layer
        counts = set()
    # transformers gives every config a per-layer view; a layer without its own KV heads has none
    per_layer = getattr(text, "per_layer_config", None)
    if per_layer is not None:
        for i in range(int(text.num_hidden_layers)):
            kv = getattr(per_layer[i], "num_key_value_heads", None)
            if kv:
                counts.add(int(kv))
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's {heads} attention heads; "
            f"use a tensor_parallel_size that divides {heads}"
        )
    for kv in sorted(counts):
        _check_kv_heads(kv, tp_size)


def _check_kv_heads(kv: int, tp_size: int) -> None:
    if kv >= tp_size and kv % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's {kv} KV heads; "
            f"use a tensor_parallel_size that divides {kv}"
        )
    if kv < tp_size and tp_size % kv:
        raise ValueError(
            f"tensor_parallel_size={tp_size} is not a multiple of the model's {kv} KV heads "
            f"(fewer KV heads than ranks are replicated, {tp_size} / {kv} must be whole)"
        )


@dataclass(frozen=True)
class StackedParam:
    """An HF tensor whose name contains `hf_piece` is one shard (`shard_id`) of the parameter named with
    `param_piece` instead (e.g. ".q_proj." -> ".qkv_proj.", "q")."""

    hf_piece: str
    param_piece: str
    shard_id: object


def load_weights_into(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, Loaded]],
    stacked: Sequence[StackedParam] = (),
    *,
    skip: Sequence[str] = (),
    renames: Sequence[tuple[str, str]] = (),
    ignore_unexpected: bool = False,
    name_map: Callable[[str], tuple[str, object] | None] | None = None,
) -> None:
    """Copy HF-named `weights` into `model`'s parameters through their `weight_loader`.

    `skip`: name suffixes ignored (tied heads, rotary buffers). `renames`: (old prefix, new prefix) applied
    first. `name_map`: (parameter name, shard id) for the tensors it knows (None for the others), tried
    before `stacked` (MoE experts: the expert id is in the name). Raises ValueError naming the tensor on a shape mismatch or a tensor with no parameter (unless
    `ignore_unexpected`), and naming the parameters no tensor covered."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, set[object]] = {}
    for name, tensor in weights:
        if any(name.endswith(s) for s in skip):
            continue
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        target, shard_id = name, None
        mapped = name_map(name) if name_map is not None else None
        if mapped is not None:
            target, shard_id = mapped
        for sp in () if mapped is not None else stacked:
            if sp.hf_piece in name:
                target, shard_id = name.replace(sp.hf_piece, sp.param_piece), sp.shard_id
                break
        param = params.get(target)
        if param is None:
            if ignore_unexpected:
                continue
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.setdefault(target, set()).add(shard_id)
    missing: list[str] = []
    seen: set[int] = set()
    for pname, param in model.named_parameters():  # duplicates (tied weights) removed
        if id(param) in seen:
            continue
        seen.add(id(param))
        got = loaded.get(pname, set())
        shard_ids = _owner_shard_ids(model, pname)
        if None in got or (got and not shard_ids):
            continue
        for sid in shard_ids or (None,):
            if sid is None or sid not in got:
                missing.append(_hf_name(pname, sid, stacked))
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing)}")


def _hf_name(pname: str, shard_id: object, stacked: Sequence[StackedParam]) -> str:
    """The HF name a missing (shard of a) parameter is loaded from."""
    if shard_id is not None:
        for sp in stacked:
            if sp.param_piece in pname and sp.shard_id == shard_id:
                return pname.replace(sp.param_piece, sp.hf_piece)
        return f"{pname} (shard {shard_id})"
    return pname


def _owner_shard_ids(model: torch.nn.Module, pname: str) -> tuple[object, ...]:
    module_name = pname.rsplit(".", 1)[0] if "." in pname else ""
    owner = model.get_submodule(module_name) if module_name else model
    return tuple(getattr(owner, "shard_ids", ()))
