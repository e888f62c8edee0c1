"""Loading a model: build it for its config, load and check its weights, prepare it for its device, load
its tokenizer.

A GGUF file loaded with dtype "auto" on CPU keeps its quantized tensors in their block layout (the CPU
kernels multiply them; under tensor parallelism each rank keeps its shard's blocks); any explicit dtype or
a GPU loads the float32 dequantized tensors of the cache folder instead (the oracle the quantized path is
tested against), except a file's Q8_0 experts on a GPU: they stay Q8_0 for the fused experts kernel. A
GPTQ/AWQ/FP8 checkpoint goes through `pagedrs.quantization.checkpoint`.

Every check happens here, at load time: unknown path or architecture, a checkpoint missing a tensor or
holding one of the wrong shape -> ValueError naming it, before any request can be accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import Loaded
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.loader.checkpoint import checkpoint_weights
from pagedrs.loader.dtype import resolve_dtype
from pagedrs.loader.gguf import head_counts, iter_gguf_weights
from pagedrs.loader.gguf_moe import has_q8_0_experts, q8_0_experts_only
from pagedrs.loader.gguf_reader import open_gguf
from pagedrs.loader.options import LoadOptions, apply_overrides, init_dummy_weights
from pagedrs.loader.paths import gguf_file, model_folder, resolve_model_path
from pagedrs.loader.safetensors import TensorSlice
from pagedrs.loader.tokenizer import tokenizer_from
from pagedrs.models.interface import CausalLM
from pagedrs.models.prepare import PrepareOptions, prepare_for_device
from pagedrs.models.registry import text_part
from pagedrs.quantization.checkpoint import quantized_checkpoint
from pagedrs.quantization.config import QuantConfig, detect_quantization

__all__ = ["LoadedModel", "keeps_quantized", "load_hf_config", "load_model", "packed_form"]


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: transformers.PretrainedConfig
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None when loaded without (a worker rank)
    model_path: str  # what was resolved: the folder, or the GGUF file

    max_len_cap: int | None = None  # disable_sliding_window: the context is capped at the window
    quantization: str | None = None  # what was loaded: "gguf", "gptq", "awq", "fp8", "compressed-tensors"

    @functools.cached_property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids (tokenizer, config, generation_config.json), read once."""
        from pagedrs.loader.eos import eos_token_ids

        return eos_token_ids(self.tokenizer, self.hf_config, str(self.model_path))

    @property
    def weight_nbytes(self) -> int:
        """Bytes the weights take: dense parameters, plus packed weights at their packed size."""
        dense = sum(p.numel() * p.element_size() for p in self.model.parameters())
        packed: dict[int, int] = {}  # by id: a tied output head shares its table's slot
        for m in self.model.modules():
            quant = getattr(getattr(m, "quant", None), "weight", None)
            for q in (getattr(m, "qweight", None), quant, getattr(m, "kernel_weight", None)):
                if q is not None:
                    packed[id(q)] = int(q.nbytes)
        return dense + sum(packed.values())

    @property
    def max_len(self) -> int:
        """The longest sequence the model takes (its position limit, or the cap)."""
        limit = int(
            getattr(self.model, "max_position", None)
            or getattr(self.hf_config, "max_position_embeddings", None)
            or 2048
        )
        return min(limit, self.max_len_cap) if self.max_len_cap else limit


def load_hf_config(model: str | None, opts: LoadOptions | None = None) -> transformers.PretrainedConfig:
    """The HF config of `model` (folder, GGUF file or None) with `opts.overrides` applied, no weights."""
    opts = opts or LoadOptions()
    folder = model_folder(resolve_model_path(model, opts.revision, opts.download_dir, opts=opts))
    config = text_part(
        transformers.AutoConfig.from_pretrained(folder, trust_remote_code=opts.trust_remote_code)
    )
    apply_overrides(config, opts.overrides)
    return config


def keeps_quantized(path: str, dtype: str | torch.dtype, device: torch.device, load_format: str) -> bool:
    """Whether `load_model` keeps a GGUF file's quantized tensors quantized (see the module docstring)."""
    if gguf_file(path) is None or load_format not in ("auto", "gguf"):
        return False
    return dtype == "auto" and device.type == "cpu"


def keeps_q8_0_experts(gguf_path: Path, device: torch.device, load_format: str) -> bool:
    """Whether a GGUF file's Q8_0 experts stay Q8_0 for the CUDA fused experts kernel (a CUDA device; every
    other tensor then loads dequantized, as from the cache folder)."""
    if device.type != "cuda" or load_format not in ("auto", "gguf"):
        return False
    return has_q8_0_experts(open_gguf(gguf_path))


def load_model(
    model: str | None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tokenizer: str | None = None,
    tp: TPGroup | None = None,
    with_tokenizer: bool = True,
    opts: LoadOptions | None = None,
) -> LoadedModel:
    """Build the model for `model` (folder, GGUF file or None), load and check its weights, load the
    tokenizer (from `tokenizer` when given, else from the model). With `tp`, this rank's shard only.
    The weights' CPU forms are given here (Q8_0 at load, the quantized CPU path's ops); the model runner
    gives the rest (`pagedrs.models.prepare`)."""
    from pagedrs.models.registry import get_model_class
    from pagedrs.models.utils import check_tensor_parallel

    opts = opts or LoadOptions()
    path = resolve_model_path(model, opts.revision, opts.download_dir, opts=opts)
    folder = model_folder(path)
    device = torch.device(device)
    config = text_part(
        transformers.AutoConfig.from_pretrained(folder, trust_remote_code=opts.trust_remote_code)
    )
    cap = apply_overrides(config, opts.overrides)
    model_cls = get_model_class(config)
    torch_dtype = resolve_dtype(dtype, config, device)
    if tp is not None and tp.size > 1:
        check_tensor_parallel(config, tp.size)
    quant = detect_quantization(config, folder, opts.quantization) if gguf_file(path) is None else None
    q8_0 = opts.quantization == "q8_0"
    if q8_0:
        _check_q8_0(path, torch_dtype, device)  # before any weight is read
    with torch.device(device):
        net = model_cls(config, dtype=torch_dtype, device=device, tp=tp)
    cpu_quantized = _load_weights(net, path, folder, config, quant, dtype, device, opts)
    opts_here = PrepareOptions(after_load=True, quantize_q8_0=q8_0, cpu_quantized=cpu_quantized or q8_0)
    prepare_for_device(net, opts_here)
    net.eval()
    tok = None
    if with_tokenizer:
        source = (
            folder
            if tokenizer is None
            else resolve_model_path(
                tokenizer, opts.tokenizer_revision, opts.download_dir, opts=opts, weights=False
            )
        )
        tok = tokenizer_from(source, opts)
    qname = (
        "gguf" if gguf_file(path) is not None else (quant.name if quant is not None else opts.quantization)
    )
    return LoadedModel(
        model=net, hf_config=config, tokenizer=tok, model_path=path, max_len_cap=cap, quantization=qname
    )


def _load_weights(
    net: torch.nn.Module,
    path: str,
    folder: str,
    config: transformers.PretrainedConfig,
    quant: QuantConfig | None,
    dtype: str | torch.dtype,
    device: torch.device,
    opts: LoadOptions,
) -> bool:
    """Load `net`'s weights as `opts` say; whether they are on the quantized CPU path (GGUF blocks kept,
    or a quantized checkpoint's layers kept as blocks on a CPU)."""
    if opts.load_format == "dummy":
        init_dummy_weights(net, opts.seed)
        return False
    if keeps_quantized(path, dtype, device, opts.load_format):
        num_heads, num_kv_heads = head_counts(config)
        gguf_path = gguf_file(path)
        assert gguf_path is not None  # keeps_quantized checked it
        net.load_weights(iter_gguf_weights(gguf_path, num_heads, num_kv_heads))  # type: ignore[operator]  # as below
        return True
    gguf_path = gguf_file(path)
    if gguf_path is not None and keeps_q8_0_experts(gguf_path, device, opts.load_format):
        num_heads, num_kv_heads = head_counts(config)
        net.load_weights(q8_0_experts_only(iter_gguf_weights(gguf_path, num_heads, num_kv_heads)))  # type: ignore[operator]  # as below
        return False
    weights = checkpoint_weights(path, folder, opts.load_format)
    if quant is not None:
        weights = _quantized(weights, quant, dtype, device)
    # each architecture's own loader (not a torch.nn.Module method, so not on CausalLM's stub)
    net.load_weights(weights)  # type: ignore[operator]
    return device.type == "cpu" and any(
        isinstance(getattr(m, "qweight", None), QuantizedWeight) for m in net.modules()
    )


def _check_q8_0(path: str, dtype: torch.dtype, device: torch.device) -> None:
    """quantization="q8_0" needs a 16/32-bit checkpoint and the CPU kernels' float32 activations."""
    if gguf_file(path) is not None:
        raise ValueError(
            f"quantization='q8_0' quantizes a 16/32-bit checkpoint; {path!r} is a GGUF file already"
        )
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"quantization='q8_0' runs on the CPU kernels, which take float32 activations: needs device cpu "
            f"and dtype auto or float32, got device {device.type!r}, dtype {str(dtype).removeprefix('torch.')!r}"
        )


def _quantized(
    weights: Iterator[tuple[str, Loaded | TensorSlice]],
    quant: QuantConfig,
    dtype: str | torch.dtype,
    device: torch.device,
) -> Iterator[tuple[str, Loaded | TensorSlice]]:
    """A GPTQ/AWQ/FP8 checkpoint's weights as the layers take them: packed GGUF blocks on the GGUF rule
    (dtype "auto" on CPU) where that is exact, else dequantized to float32 at load. Under tensor
    parallelism each rank cuts its share of the packed blocks (column-parallel layers: whole rows;
    row-parallel: whole 32-weight blocks of the input, each carrying its group's scale, so a cut inside
    a GPTQ group of 128 is still exact) or of the float weight."""
    return quantized_checkpoint(weights, quant, keep_packed=packed_form(dtype, device))


def packed_form(dtype: str | torch.dtype, device: torch.device) -> str | None:
    """How a GPTQ/AWQ/FP8 checkpoint's layers are kept: "gguf" on CPU with dtype "auto" (the CPU
    kernels' blocks, where exact), "device" on a GPU (the checkpoint's own packing, multiplied through
    pagedrs.layers.packed), else None (dequantized to float32 at load)."""
    if device.type == "cuda":
        return "device"
    return "gguf" if dtype == "auto" and device.type == "cpu" else None
