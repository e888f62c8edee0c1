"""Weights from PyTorch checkpoints: `pytorch_model.bin` or shards listed in
`pytorch_model.bin.index.json`. Loaded with `torch.load(weights_only=True)`: tensors and plain
containers only, never arbitrary pickled objects."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from pagedrs.loader.index import indexed_files

__all__ = ["pytorch_bin_files", "iter_pytorch_bin"]

INDEX_NAME = "pytorch_model.bin.index.json"


def pytorch_bin_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    files = indexed_files(folder, INDEX_NAME)
    if files is not None:
        return files
    single = folder / "pytorch_model.bin"
    return [single] if single.is_file() else []


def iter_pytorch_bin(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    for path in files:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # old (non-zip) serialization cannot be memory-mapped
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{path} does not hold a state dict")
        if "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        for name, tensor in state.items():
            if isinstance(tensor, Tensor):
                yield name, tensor
        del state
