"""pagedrs's one-pass GGUF header reader gives what `gguf.GGUFReader` gives (every field's value and type,
every tensor's name, type, shape, offset and data view), and a damaged file is a ValueError."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedrs.loader.gguf_reader import GGUFFile, open_gguf


def _write(path: Path, alignment: int | None = None) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -5)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.tokens", ["a", "", "ü", "<|im_end|>"] * 50)
    w.add_array("t.scores", [0.5, -1.0, 2.0])
    w.add_array("t.types", [1, 2, 3])
    w.add_array("t.flags", [True, False])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_equal_gguf_reader(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    ref, ours = gguf.GGUFReader(str(path)), open_gguf(path)
    assert isinstance(ours, GGUFFile)
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        assert field.contents() == ref.fields[key].contents(), key
        assert list(field.types) == list(ref.fields[key].types), key
    assert ours.get_field("t.tokens").contents()[2] == "ü" and ours.get_field("missing") is None
    assert len(ours.tensors) == len(ref.tensors) == 4
    for a, b in zip(ref.tensors, ours.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_bytes,
            b.data_offset,
        )
        assert list(a.shape) == list(b.shape) and a.n_elements == b.n_elements
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)


def test_damaged_files_are_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: len(raw) - 50])  # the last tensor runs past the end
    with pytest.raises(ValueError, match="'q8' runs past the end"):
        GGUFFile(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(raw[:200])  # inside the metadata
    with pytest.raises(ValueError, match="truncated GGUF header"):
        GGUFFile(head)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + raw[4:])
    with pytest.raises(ValueError, match="bad magic"):
        GGUFFile(bad)
