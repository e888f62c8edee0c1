"""A model folder's weights, one (HF name, tensor) at a time: safetensors preferred, else PyTorch .bin, or the
kind `load_format` names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pagedrs.layers.linear import Loaded
from pagedrs.loader.pytorch_bin import iter_pytorch_bin, pytorch_bin_files
from pagedrs.loader.safetensors import TensorSlice, iter_safetensors, safetensors_files

__all__ = ["checkpoint_weights", "iter_checkpoint"]


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


def checkpoint_weights(
    path: str, folder: str, load_format: str
) -> Iterator[tuple[str, Loaded | TensorSlice]]:
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
