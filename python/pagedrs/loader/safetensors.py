"""Weights from safetensors checkpoints: one `model.safetensors` or shards listed in
`model.safetensors.index.json` (any other *.safetensors files in the folder as a fallback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open
from torch import Tensor

from pagedrs.loader.index import indexed_files

__all__ = ["safetensors_files", "iter_safetensors"]

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


def iter_safetensors(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every tensor of every file, one tensor in memory at a time."""
    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
