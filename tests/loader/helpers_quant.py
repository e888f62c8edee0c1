"""Tiny GPTQ / AWQ / FP8 checkpoints written with the formats' own packing, and the float32 checkpoint of
the same model whose weights are the dequantized values (the oracle the quantized loads are compared to).

The reference quantizers here pack with numpy (shift left and OR) independently of the loader's unpacking:
- GPTQ: `qweight` int32 [in / k, out] (k = 32 / bits values per word, value j in bits [j*bits, ..), along the
  input dim); `qzeros` int32 [groups, out / k] along the output dim, each zero stored minus one (AutoGPTQ's
  v1 zero-point convention); `scales` fp16 [groups, out]; `g_idx` int32 [in].
- AWQ (GEMM): `qweight` int32 [in, out / 8], `qzeros` int32 [groups, out / 8], nibble i of a word holding
  column AWQ_ORDER[i] of its 8 (AutoAWQ's interleave); zeros stored as they are; `scales` fp16.
- FP8: `weight` float8_e4m3fn and `weight_scale` float32 (one, or one per output row), or
  `weight_scale_inv` per 2-D block (the block-FP8 checkpoints' name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import make_tiny_llama

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_along_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """uint values [n, m] -> int32 [n / k, m]: row k*r + j in bits [j*bits, (j+1)*bits) of word [r, :]."""
    k = 32 // bits
    v = q.astype(np.uint32).reshape(q.shape[0] // k, k, q.shape[1])
    out = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for j in range(k):
        out |= v[:, j, :] << np.uint32(bits * j)
    return out.view(np.int32)


def pack_along_cols(q: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint values [n, m] -> int32 [n, m / k]: slot j of word [:, c] holds column k*c + order[j]."""
    k = 32 // bits
    order = order or tuple(range(k))
    v = q.astype(np.uint32).reshape(q.shape[0], q.shape[1] // k, k)
    out = np.zeros(v.shape[:2], dtype=np.uint32)
    for j in range(k):
        out |= v[:, :, order[j]] << np.uint32(bits * j)
    return out.view(np.int32)


def gptq_quantize(
    w: torch.Tensor, bits: int, group_size: int, sym: bool, desc_act: bool, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(GPTQ tensors of W [out, in], the float32 [out, in] they dequantize to)."""
    out_f, in_f = w.shape
    maxq = (1 << bits) - 1
    group = in_f if group_size == -1 else group_size
    groups = in_f // group
    order = (
        torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))
        if desc_act
        else torch.arange(in_f)
    )
    g_idx = torch.empty(in_f, dtype=torch.int64)
    g_idx[order] = torch.arange(in_f) // group  # act-order: groups follow the permuted input order
    wt = w.t().to(torch.float32)  # [in, out]
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        if sym:
            scales[g] = rows.abs().amax(0).clamp_min(1e-4) / ((maxq + 1) / 2 - 1)
            zeros[g] = (maxq + 1) // 2
        else:
            lo, hi = rows.amin(0).clamp_max(0), rows.amax(0).clamp_min(0)
            scales[g] = ((hi - lo) / maxq).clamp_min(1e-4)
            zeros[g] = torch.round(-lo / scales[g]).clamp(1, maxq).to(torch.int64)  # v1 stores zero - 1 >= 0
    scales = scales.to(torch.float16)
    s32 = scales.to(torch.float32)
    q = torch.clamp(torch.round(wt / s32[g_idx]) + zeros[g_idx], 0, maxq).to(torch.int64)
    deq = ((q - zeros[g_idx]).to(torch.float32) * s32[g_idx]).t().contiguous()
    parts = {
        "qweight": torch.from_numpy(pack_along_rows(q.numpy(), bits)),
        "qzeros": torch.from_numpy(pack_along_cols((zeros - 1).numpy(), bits)),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    return parts, deq


def awq_quantize(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(AWQ GEMM tensors of W [out, in] (4-bit, zero points), the float32 [out, in] they dequantize to)."""
    out_f, in_f = w.shape
    wt = w.t().to(torch.float32).reshape(in_f // group_size, group_size, out_f)
    lo, hi = wt.amin(1).clamp_max(0), wt.amax(1).clamp_min(0)
    scales = ((hi - lo) / 15).clamp_min(1e-4).to(torch.float16)
    s32 = scales.to(torch.float32)
    zeros = torch.round(-lo / s32).clamp(0, 15).to(torch.int64)  # [groups, out]
    q = torch.clamp(torch.round(wt / s32[:, None]) + zeros[:, None], 0, 15).to(torch.int64)
    deq = ((q - zeros[:, None]).to(torch.float32) * s32[:, None]).reshape(in_f, out_f).t().contiguous()
    parts = {
        "qweight": torch.from_numpy(pack_along_cols(q.reshape(in_f, out_f).numpy(), 4, AWQ_ORDER)),
        "qzeros": torch.from_numpy(pack_along_cols(zeros.numpy(), 4, AWQ_ORDER)),
        "scales": scales,
    }
    return parts, deq


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per block [ceil(out / br), ceil(in / bc)]): each block's max |w| maps
    to 448 (partial blocks at the edges, as the checkpoints' quantizers write them)."""
    w = w.to(torch.float32)
    (o, i), (br, bc) = w.shape, block
    pad = torch.zeros(-(-o // br) * br, -(-i // bc) * bc)
    pad[:o, :i] = w
    tiles = pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
    scale = tiles.abs().amax((1, 3)).clamp(min=1e-8) / 448.0
    return (w / _block_full(scale, block, w.shape)).to(torch.float8_e4m3fn), scale.contiguous()


def _block_full(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """A per-block scale repeated over every element of a weight of `shape`."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def fp8_quantize(
    w: torch.Tensor, strategy: str, block: int | tuple[int, int] = 32
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(FP8 e4m3 weight with its scale(s) for `strategy` tensor | channel | block, the dequantized float32)."""
    w = w.to(torch.float32)
    if strategy == "block":
        blk = (block, block) if isinstance(block, int) else block
        q, scale = fp8_block_quantize(w, blk)
        return {"weight": q, "weight_scale_inv": scale}, q.to(torch.float32) * _block_full(
            scale, blk, w.shape
        )
    amax = w.abs().amax() if strategy == "tensor" else w.abs().amax(1, keepdim=True)
    scale = amax.clamp(min=1e-8) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.to(torch.float32) * scale


def quant_config_of(method: str, **kw: Any) -> dict[str, Any]:
    """The `quantization_config` a checkpoint of `method` declares in its config.json."""
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": kw["bits"],
            "group_size": kw["group_size"],
            "desc_act": kw["desc_act"],
            "sym": kw["sym"],
            "checkpoint_format": "gptq",
        }
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": kw["group_size"],
            "zero_point": True,
            "version": "gemm",
        }
    if method == "fp8" and kw["strategy"] == "block":
        block = list(kw.get("block", (32, 32)))
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    weights = {"num_bits": 8, "type": "float", "strategy": kw["strategy"], "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def make_quantized_pair(tmp_path: Path, method: str, **kw: Any) -> tuple[Path, Path]:
    """(a tiny Llama checkpoint of `method` with its linear layers quantized, the float32 checkpoint of the
    same model with those layers' dequantized values). kw: bits, group_size, sym, desc_act (gptq);
    group_size (awq); strategy tensor | channel | block (fp8, compressed-tensors)."""
    src = make_tiny_llama(tmp_path, subdir=f"src-{method}")
    state = load_file(str(src / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            quant[name] = ref[name] = w
            continue
        if method == "gptq":
            parts, deq = gptq_quantize(w, kw["bits"], kw["group_size"], kw["sym"], kw["desc_act"], seed=i)
        elif method == "awq":
            parts, deq = awq_quantize(w, kw["group_size"])
        else:
            parts, deq = fp8_quantize(w, kw["strategy"])
        quant.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
        ref[name] = deq
    qdir, rdir = tmp_path / f"{method}-quant", tmp_path / f"{method}-ref"
    write_pair(src, (qdir, quant, quant_config_of(method, **kw)), (rdir, ref))
    return qdir, rdir


def write_pair(
    src: Path,
    quantized: tuple[Path, dict[str, torch.Tensor], dict[str, Any]],
    reference: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """The quantized checkpoint (folder, tensors, its `quantization_config`) and the float32 reference
    (folder, tensors), each a copy of `src`'s other files with its own `model.safetensors`."""
    for d, tensors, qc in (quantized, (*reference, None)):
        d.mkdir(exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        if qc is not None:
            config = json.loads((d / "config.json").read_text())
            config["quantization_config"] = qc
            (d / "config.json").write_text(json.dumps(config))
