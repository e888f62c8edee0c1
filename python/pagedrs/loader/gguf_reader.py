"""A GGUF file's metadata and tensor table, read in one pass.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, so a file with a 50k-150k
token vocabulary (tokens, scores, token types, merges) takes seconds to open on a small CPU, once per process
that opens it. This reader decodes the same header with `struct` (the vocabulary as plain Python lists) and
exposes what the loader uses, with `GGUFReader`'s names: `get_field(key).contents()`, `fields`, and
`tensors` (`name`, `tensor_type`, `shape` fastest-varying first, `n_elements`, `n_bytes`, `data_offset`,
`data`: a read-only view of the memory map, shaped as `GGUFReader` shapes it). Little-endian files (what
llama.cpp writes); a big-endian file is handed to `gguf.GGUFReader`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFField", "GGUFFile", "GGUFTensor", "field_value", "open_gguf"]

_MAGIC = 0x46554747  # b"GGUF" read little-endian
_DEFAULT_ALIGNMENT = 32
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
_DENSE: dict[int, Any] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFField:
    """One metadata key: its GGUF value type (`types[0]`; `types[1]` the element type of an array) and value."""

    name: str
    types: tuple[GGUFValueType, ...]
    value: Any

    def contents(self) -> Any:
        """The value as `GGUFReader`'s `ReaderField.contents()` gives it (arrays as lists)."""
        return self.value


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as e:
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}") from e
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        s = str(self.buf[self.pos : end], "utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int) -> tuple[tuple[GGUFValueType, ...], Any]:
        if vtype == GGUFValueType.STRING:
            return (GGUFValueType.STRING,), self.string()
        if vtype in _SCALARS:
            return (GGUFValueType(vtype),), self.unpack(_SCALARS[vtype])
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if etype in _ARRAY_DTYPES:  # numbers: one numpy read for the whole array
            dtype = np.dtype(_ARRAY_DTYPES[etype])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
            values = np.frombuffer(self.buf[self.pos : end], dtype=dtype).tolist()
            self.pos = end
            return (GGUFValueType.ARRAY, GGUFValueType(etype)), values
        items = [self.value(etype)[1] for _ in range(count)]  # strings, or nested arrays
        return (GGUFValueType.ARRAY, GGUFValueType(etype)), items


class GGUFFile:
    """The metadata and tensor table of one GGUF file (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        cur = _Cursor(memoryview(self.data), self.path)  # type: ignore[arg-type]
        if len(self.data) < 24 or cur.unpack("<I") != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        tensor_count, kv_count = cur.unpack("<Q"), cur.unpack("<Q")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            key = cur.string()
            types, value = cur.value(cur.unpack("<I"))
            self.fields[key] = GGUFField(key, types, value)
        infos = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = self.fields.get("general.alignment")
        self.alignment = int(align.value) if align is not None else _DEFAULT_ALIGNMENT
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{self.path}: invalid general.alignment {self.alignment}")
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> GGUFTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise ValueError(f"{self.path}: tensor {name!r} has an unknown GGML type {raw_type}") from e
        n_elems = int(np.prod(dims)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elems * type_size // block
        start = self.data_offset + offset
        if start + n_bytes > len(self.data):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        np_dims = tuple(reversed(dims))
        if ggml_type in _DENSE:
            data = self.data[start : start + n_bytes].view(_DENSE[ggml_type]).reshape(np_dims)
        else:
            if np_dims[-1] % block:
                raise ValueError(f"{self.path}: tensor {name!r} rows are not whole {ggml_type.name} blocks")
            data = self.data[start : start + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        shape = np.array(dims, dtype=np.uint64)
        return GGUFTensor(name, ggml_type, shape, n_elems, n_bytes, start, data)

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)


def field_value(reader: Any, key: str) -> Any:
    """The value of metadata key `key` of a `GGUFFile` or `gguf.GGUFReader` (None where the file has none)."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def open_gguf(path: str | Path) -> Any:
    """A `GGUFFile` for `path`; `gguf.GGUFReader` for a big-endian file (which this reader does not decode)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and struct.unpack("<I", head[4:])[0] & 0xFFFF == 0:
        import gguf

        return gguf.GGUFReader(str(path))
    return GGUFFile(path)
