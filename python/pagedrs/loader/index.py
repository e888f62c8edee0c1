"""Sharded checkpoints: the `*.index.json` beside the shards (safetensors or PyTorch .bin) maps each
tensor name to the file holding it."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["indexed_files"]


def indexed_files(folder: Path, index_name: str) -> list[Path] | None:
    """The shard files `folder/index_name` lists, in first-listed order; None if there is no index.
    ValueError naming the file when a listed shard is missing."""
    index = folder / index_name
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    files = [folder / f for f in dict.fromkeys(weight_map.values())]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{index} lists {f.name}, which is missing")
    return files
