"""Model loading: a local HF folder (config.json + safetensors or PyTorch .bin, sharded or not, tokenizer
files), a GGUF file (converted once into a cache folder), a Hugging Face Hub name (fetched into the HF
cache: `hub.py`), or None for the default model.

A GGUF file loaded with dtype "auto" on CPU keeps its quantized tensors in their block layout (the CPU
kernels multiply them; under tensor parallelism each rank keeps its shard's blocks); any explicit dtype or
a GPU loads the float32 dequantized tensors of the cache folder instead (the oracle the quantized path is
tested against).

Every check happens here, at load time: unknown path or architecture, a checkpoint missing a tensor or
holding one of the wrong shape -> ValueError naming it, before any request can be accepted.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import Loaded
from pagedrs.layers.quantized import QuantizedWeight, use_cpu_fused_ops
from pagedrs.loader.default_model import default_model_path
from pagedrs.loader.gguf import cache_root, convert_gguf, iter_gguf_weights
from pagedrs.loader.options import LoadOptions, apply_overrides, init_dummy_weights
from pagedrs.loader.pytorch_bin import iter_pytorch_bin, pytorch_bin_files
from pagedrs.loader.quant_config import QuantConfig, detect_quantization
from pagedrs.loader.quant_weights import quantized_checkpoint
from pagedrs.loader.safetensors import TensorSlice, iter_safetensors, safetensors_files
from pagedrs.models.cpu_decode import enable_cpu_decode
from pagedrs.models.interface import CausalLM

__all__ = [
    "LoadOptions",
    "LoadedModel",
    "cache_root",
    "gguf_file",
    "iter_checkpoint",
    "keeps_quantized",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "model_folder",
    "resolve_dtype",
    "resolve_model_path",
    "resolve_paths",
]

logger = logging.getLogger("pagedrs.loader")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


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
            for q in (getattr(m, "qweight", None), getattr(getattr(m, "quant", None), "weight", None)):
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


def resolve_model_path(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    *,
    opts: LoadOptions | None = None,
    weights: bool = True,
) -> str:
    """Absolute path of a local model folder or GGUF file; None -> the default model's GGUF file.

    A name like "org/model" (or "gpt2", or "org/model:Q4_K_M" for one GGUF file) that is not a local path
    is fetched from the Hugging Face Hub (`pagedrs.loader.hub`), only the files loading reads; `weights=False`
    fetches a tokenizer's files only. `opts` supplies gguf_file, the token, load_format and
    trust_remote_code. ValueError naming the path or repo when nothing is found."""
    from pagedrs.loader import hub

    opts = opts or LoadOptions()
    if model is None:
        return str(default_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if opts.gguf_file is not None and path.is_dir():
            path = path / opts.gguf_file
            if not path.is_file():
                raise ValueError(f"gguf_file {opts.gguf_file!r} is not in the model folder {model!r}")
        # absolute, symlinks kept: a Hub snapshot's file is a link to a blob named by its hash, and the
        # link's name (its .gguf suffix) is what says what the file is
        return os.path.abspath(path)
    if hub.is_hub_name(model):
        return hub.fetch(
            model,
            revision=revision,
            download_dir=download_dir,
            token=opts.token,
            gguf_file=opts.gguf_file if weights else None,
            load_format=opts.load_format,
            weights=weights,
            trust_remote_code=opts.trust_remote_code,
        )
    raise ValueError(
        f"model {model!r} not found: pass a local HF model folder (config.json + weights), a .gguf file, "
        "a Hugging Face Hub name (org/name), or nothing for the default model"
    )


def resolve_paths(model: str | None, tokenizer: str | None, opts: LoadOptions) -> tuple[str, str | None]:
    """(model path, tokenizer path or None) with Hub names fetched: what the engine's first process does
    once, so that the core process and the tensor-parallel ranks only ever see local paths."""
    path = resolve_model_path(model, opts.revision, opts.download_dir, opts=opts)
    tok = None
    if tokenizer is not None:
        tok = resolve_model_path(
            tokenizer, opts.tokenizer_revision, opts.download_dir, opts=opts, weights=False
        )
    return path, tok


def model_folder(path: str) -> str:
    """The HF-style folder for a resolved path: the folder itself, or the GGUF cache folder."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path!r} is not a .gguf file; pass the model folder instead")
        return str(convert_gguf(p))
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(convert_gguf(ggufs[0]))
        raise ValueError(f"model folder {path!r} has no config.json")
    return str(p)


def gguf_file(path: str) -> Path | None:
    """The GGUF file a resolved model path stands for (the file, or the only .gguf of a folder without
    config.json), else None."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def keeps_quantized(path: str, dtype: str | torch.dtype, device: torch.device, load_format: str) -> bool:
    """Whether `load_model` keeps a GGUF file's quantized tensors quantized (see the module docstring)."""
    if gguf_file(path) is None or load_format not in ("auto", "gguf"):
        return False
    return dtype == "auto" and device.type == "cpu"


def iter_checkpoint(folder: str | Path) -> Iterator[tuple[str, Loaded | TensorSlice]]:
    """(HF name, tensor) of a folder's checkpoint: safetensors preferred, else PyTorch .bin."""
    files = safetensors_files(folder)
    if files:
        return iter_safetensors(files)
    bins = pytorch_bin_files(folder)
    if bins:
        return iter_pytorch_bin(bins)
    raise ValueError(
        f"model folder {str(folder)!r} has no weights (model.safetensors, pytorch_model.bin or a sharded index)"
    )


def resolve_dtype(
    dtype: str | torch.dtype, config: transformers.PretrainedConfig, device: torch.device
) -> torch.dtype:
    """ "auto": float32 on CPU; on CUDA the checkpoint's half type, bfloat16 for float32 checkpoints."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}") from None
    if device.type == "cpu":
        return torch.float32
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = _DTYPES.get(cfg)
    if cfg in (torch.float16, torch.bfloat16):
        return cfg
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _load_tokenizer(source: str, opts: LoadOptions | None = None) -> transformers.PreTrainedTokenizerBase:
    opts = opts or LoadOptions()
    kw: dict = {"use_fast": opts.tokenizer_mode != "slow", "trust_remote_code": opts.trust_remote_code}
    try:
        if source.lower().endswith(".gguf"):
            p = Path(source)
            return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
        return transformers.AutoTokenizer.from_pretrained(source, **kw)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {source!r}: {e}") from e


def load_tokenizer(
    model: str | None, tokenizer: str | None = None, opts: LoadOptions | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer `load_model` would load (for a frontend whose engine core loads the model)."""
    opts = opts or LoadOptions()
    if tokenizer is not None:
        return _load_tokenizer(
            resolve_model_path(
                tokenizer, opts.tokenizer_revision, opts.download_dir, opts=opts, weights=False
            ),
            opts,
        )
    return _load_tokenizer(
        model_folder(resolve_model_path(model, opts.revision, opts.download_dir, opts=opts)), opts
    )


def load_hf_config(model: str | None, opts: LoadOptions | None = None) -> transformers.PretrainedConfig:
    """The HF config of `model` (folder, GGUF file or None) with `opts.overrides` applied, no weights."""
    opts = opts or LoadOptions()
    folder = model_folder(resolve_model_path(model, opts.revision, opts.download_dir, opts=opts))
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=opts.trust_remote_code)
    apply_overrides(config, opts.overrides)
    return config


def _checkpoint(path: str, folder: str, load_format: str) -> Iterator[tuple[str, Loaded | TensorSlice]]:
    """The weights `load_format` names (ValueError when the folder has none of that kind)."""
    if load_format == "safetensors":
        files = safetensors_files(folder)
        if not files:
            raise ValueError(f"load_format='safetensors' but {folder!r} has no .safetensors files")
        return iter_safetensors(files)
    if load_format == "pt":
        bins = pytorch_bin_files(folder)
        if not bins:
            raise ValueError(f"load_format='pt' but {folder!r} has no pytorch_model*.bin files")
        return iter_pytorch_bin(bins)
    if load_format == "gguf" and not path.lower().endswith(".gguf"):
        raise ValueError(f"load_format='gguf' but {path!r} is not a .gguf file")
    return iter_checkpoint(folder)


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
    tokenizer (from `tokenizer` when given, else from the model). With `tp`, this rank's shard only."""
    from pagedrs.models.registry import get_model_class
    from pagedrs.models.utils import check_tensor_parallel

    opts = opts or LoadOptions()
    path = resolve_model_path(model, opts.revision, opts.download_dir, opts=opts)
    folder = model_folder(path)
    device = torch.device(device)
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=opts.trust_remote_code)
    cap = apply_overrides(config, opts.overrides)
    model_cls = get_model_class(config)
    torch_dtype = resolve_dtype(dtype, config, device)
    if tp is not None and tp.size > 1:
        check_tensor_parallel(config, tp.size)
    quant = detect_quantization(config, folder, opts.quantization) if gguf_file(path) is None else None
    if opts.quantization == "q8_0":
        _check_q8_0(path, torch_dtype, device)  # before any weight is read
    with torch.device(device):
        net = model_cls(config, dtype=torch_dtype, device=device, tp=tp)
    if opts.load_format == "dummy":
        init_dummy_weights(net, opts.seed)
    elif keeps_quantized(path, dtype, device, opts.load_format):
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        gguf_path = gguf_file(path)
        assert gguf_path is not None  # keeps_quantized checked it
        net.load_weights(iter_gguf_weights(gguf_path, num_heads, num_kv_heads))  # type: ignore[operator]  # as below
        use_cpu_fused_ops(net)
        enable_cpu_decode(net)
    else:
        weights = _checkpoint(path, folder, opts.load_format)
        if quant is not None:
            weights = _quantized(weights, quant, dtype, device)
        # each architecture's own loader (not a torch.nn.Module method, so not on CausalLM's stub)
        net.load_weights(weights)  # type: ignore[operator]
        if device.type == "cpu" and any(
            isinstance(getattr(m, "qweight", None), QuantizedWeight) for m in net.modules()
        ):
            use_cpu_fused_ops(net)
            enable_cpu_decode(net)
    if opts.quantization == "q8_0":
        _quantize_at_load(net)
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
        tok = _load_tokenizer(source, opts)
    qname = (
        "gguf" if gguf_file(path) is not None else (quant.name if quant is not None else opts.quantization)
    )
    return LoadedModel(
        model=net, hf_config=config, tokenizer=tok, model_path=path, max_len_cap=cap, quantization=qname
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


def _quantize_at_load(net: torch.nn.Module) -> None:
    """quantization="q8_0": the loaded float weights to Q8_0 blocks for the CPU kernels."""
    from pagedrs.layers.quantize_at_load import quantize_q8_0

    n = quantize_q8_0(net)
    logger.info("weights quantized at load to Q8_0 (the CPU kernels multiply them): %d layers", n)
    use_cpu_fused_ops(net)
    enable_cpu_decode(net)


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
