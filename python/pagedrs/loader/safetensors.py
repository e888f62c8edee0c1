"""Weights from safetensors checkpoints: one `model.safetensors` or shards listed in
`model.safetensors.index.json` (any other *.safetensors files in the folder as a fallback).

Tensors come out as `TensorSlice`s: lazy views of the file that the weight loaders cut (`narrow`, `t`) to
this rank's share before anything is read, so a tensor-parallel rank reads only its shard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from pagedrs.loader.index import indexed_files

__all__ = ["TensorSlice", "iter_safetensors", "safetensors_files"]

INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint files of a folder (empty list if it has no safetensors checkpoint)."""
    folder = Path(folder)
    files = indexed_files(folder, INDEX_NAME)
    if files is not None:
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(folder.glob("*.safetensors"))


class TensorSlice:
    """A lazy rectangle of one checkpoint tensor (2-D at most transposed): `shape`, `dim()`, `narrow()`
    and `t()` cost nothing; `materialize()` reads just the rectangle. Valid while its file is open."""

    __slots__ = ("_slice", "_ranges", "_transposed")

    def __init__(self, file_slice: object, ranges: list[tuple[int, int]], transposed: bool = False) -> None:
        self._slice = file_slice
        self._ranges = ranges  # (start, stop) per stored dim
        self._transposed = transposed

    @classmethod
    def of(cls, file_slice: object) -> TensorSlice:
        shape = file_slice.get_shape()  # type: ignore[attr-defined]  # safetensors' slice object has no stub
        return cls(file_slice, [(0, int(n)) for n in shape])

    def _dim_index(self, dim: int) -> int:
        nd = len(self._ranges)
        if not -nd <= dim < max(nd, 1):
            raise IndexError(f"dim {dim} out of range for a {nd}-d tensor")
        dim %= max(nd, 1)
        return (nd - 1 - dim) if self._transposed else dim

    @property
    def shape(self) -> torch.Size:
        sizes = [b - a for a, b in self._ranges]
        return torch.Size(sizes[::-1] if self._transposed else sizes)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> TensorSlice:
        i = self._dim_index(dim)
        a, b = self._ranges[i]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[i] = (a + start, a + start + length)
        return TensorSlice(self._slice, ranges, self._transposed)

    def t(self) -> TensorSlice:
        if len(self._ranges) != 2:
            raise ValueError(f"t() needs a 2-d tensor, got shape {tuple(self.shape)}")
        return TensorSlice(self._slice, self._ranges, not self._transposed)

    def materialize(self) -> Tensor:
        if not self._ranges:
            t = self._slice[...]  # type: ignore[index]  # a 0-d tensor (FP8's per-tensor scale) takes no slice
        else:
            t = self._slice[tuple(slice(a, b) for a, b in self._ranges)]  # type: ignore[index]  # as above: no stub for the slice
        return t.t() if self._transposed else t

    def __repr__(self) -> str:
        return f"TensorSlice(shape={tuple(self.shape)})"


def iter_safetensors(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, TensorSlice]]:
    """(name, lazy slice) for every tensor of every file; each is read when a loader materializes it."""
    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():  # safe_open is not a mapping
                yield name, TensorSlice.of(f.get_slice(name))
