"""Every kernel and every template instantiation compiles with NVRTC for sm_80 and sm_90 (PTX). No GPU needed:
this runs (and must not skip) in CI. NVRTC comes from pip: cupy-cuda12x plus nvidia-cuda-nvrtc-cu12
(or the CUDA 13 pair); the kernels include no CUDA header, so no include directory is needed."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedrs import kernels
from pagedrs.kernels import _loader

REPO = Path(__file__).resolve().parents[2]
CUDA_DIR = REPO / "cuda"


def _disk_source(name: str) -> str:
    return (CUDA_DIR / f"{name}.cu").read_text()


def _resolved_disk_source(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """What kernel_source gives for the files on disk (headers inlined)."""
    monkeypatch.setenv("PAGEDRS_CUDA_SRC_DIR", str(CUDA_DIR))
    return _loader.kernel_source(name)


@pytest.fixture(scope="module")
def nvrtc_ok() -> tuple[int, int]:
    try:
        version = kernels.nvrtc_version()
    except ImportError as e:  # not a skip: CI must have NVRTC
        pytest.fail(f"NVRTC unavailable ({e}). Install: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")
    assert version >= (11, 8), f"NVRTC {version} cannot target sm_90; need CUDA 11.8 or newer"
    return version


def test_sources_start_with_line_directive() -> None:
    for name in _loader.SOURCES:
        first = _disk_source(name).splitlines()[0]
        assert first == f'#line 1 "cuda/{name}.cu"', f"{name}.cu must start with its #line directive"


def test_sources_include_only_their_own_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA header (NVRTC needs no include directory at run time or in CI); cuda/common.cuh is inlined
    by kernel_source, followed by a #line directive that restores the file's own numbering."""
    for name in _loader.SOURCES:
        includes = re.findall(r"^\s*#\s*include\s*(\S+)", _disk_source(name), re.M)
        assert set(includes) <= {f'"{h}"' for h in _loader.HEADERS}, f"{name}.cu includes {includes}"
        text = _resolved_disk_source(name, monkeypatch)
        assert not re.search(r"^\s*#\s*include", text, re.M), f"{name}.cu still includes a header"
    for header in _loader.HEADERS:
        assert not re.search(r"^\s*#\s*include", (CUDA_DIR / header).read_text(), re.M)
    disk = _disk_source("layer_ops").splitlines()
    include = next(i for i, line in enumerate(disk) if line.startswith("#include"))
    lines = _resolved_disk_source("layer_ops", monkeypatch).splitlines()
    restart = lines.index(f'#line {include + 2} "cuda/layer_ops.cu"')
    assert lines[restart + 1 :] == disk[include + 1 :]
    assert "\n".join(lines).count("struct half_t {") == 1


def test_unknown_include_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "layer_ops.cu").write_text('#line 1 "cuda/layer_ops.cu"\n#include "cuda_fp16.h"\n')
    monkeypatch.setenv("PAGEDRS_CUDA_SRC_DIR", str(tmp_path))
    with pytest.raises(kernels.KernelCompileError, match="cuda_fp16.h"):
        _loader.kernel_source("layer_ops")


def test_embedded_sources_match_disk() -> None:
    """The extension embeds cuda/*.cu at build time; a mismatch means it needs a rebuild
    (pip install -e . --no-build-isolation --no-deps)."""
    from pagedrs._core import kernel_names, kernel_source

    assert set(_loader.SOURCES) | set(_loader.HEADERS) <= set(kernel_names())
    for name in _loader.SOURCES:
        assert kernel_source(name) == _disk_source(name), (
            f"embedded {name}.cu is stale: rebuild the extension"
        )
    for header in _loader.HEADERS:
        assert kernel_source(header) == (CUDA_DIR / header).read_text(), f"embedded {header} is stale"


def test_every_kernel_template_is_instantiated() -> None:
    instantiated = {re.sub(r"<.*", "", n) for _, names in _loader.instantiation_groups() for n in names}
    for name in _loader.SOURCES:
        for kernel in re.findall(
            r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", _disk_source(name)
        ):
            assert f"pagedrs::{kernel}" in instantiated, f"{kernel} in {name}.cu has no instantiation"


# The kernels' only architecture branch is `__CUDA_ARCH__ >= 800`, the same on sm_80 and sm_90: every
# instantiation goes through ptxas for sm_80 and through the front end to PTX for sm_90 (ptxas is half the
# cost); ptxas for sm_90 runs on the kernels the register checks below compile.
@pytest.mark.parametrize("arch", ["sm_80", "compute_90"])
def test_every_instantiation_compiles(
    arch: str, nvrtc_ok: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = _loader.instantiation_groups()
    sources = {name: _resolved_disk_source(name, monkeypatch) for name in _loader.SOURCES}

    def compile_group(group: tuple[str, tuple[str, ...]]) -> str | None:
        source, names = group
        try:
            lowered = _loader.compile_check(source, names, arch, code=sources[source])
        except _loader.KernelCompileError as e:
            return str(e)
        missing = [n for n in names if not lowered.get(n)]
        return f"{source}: no lowered name for {missing}" if missing else None

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        errors = [e for e in pool.map(compile_group, groups) if e]
    assert not errors, "\n\n".join(errors[:3])
    assert sum(len(n) for _, n in groups) > 100


def test_the_only_architecture_branch_is_sm80() -> None:
    """What lets the sm_90 check stop at PTX: a branch on a newer architecture needs sm_90 back through
    ptxas in test_every_instantiation_compiles."""
    texts = [_disk_source(name) for name in _loader.SOURCES] + [
        (CUDA_DIR / h).read_text() for h in _loader.HEADERS
    ]
    branches = {m for t in texts for m in re.findall(r"__CUDA_ARCH__\s*([<>=!]=?\s*\d+)", t)}
    assert branches == {">= 800"}, branches


def test_compile_errors_name_the_real_file(nvrtc_ok: tuple[int, int]) -> None:
    broken = _disk_source("cache_kernels").replace(
        "const long long slot = slot_mapping[t];", "const long long slot = slot_mapping[t] +;"
    )
    with pytest.raises(kernels.KernelCompileError, match=r"cuda/cache_kernels\.cu\(\d+\)"):
        _loader.compile_check("cache_kernels", _loader.cache_names(), "sm_80", code=broken)


def test_compile_errors_after_the_header_keep_the_files_line_numbers(
    nvrtc_ok: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = _disk_source("layer_ops").splitlines()
    target = next(i for i, line in enumerate(lines) if "const int nvec = hidden / VEC;" in line)
    lines[target] = lines[target].replace("hidden / VEC;", "hidden / VEC +;")
    (tmp_path / "layer_ops.cu").write_text("\n".join(lines) + "\n")
    for header in _loader.HEADERS:
        (tmp_path / header).write_text((CUDA_DIR / header).read_text())
    monkeypatch.setenv("PAGEDRS_CUDA_SRC_DIR", str(tmp_path))
    names = _loader.layer_op_names("float")
    with pytest.raises(kernels.KernelCompileError, match=rf"cuda/layer_ops\.cu\({target + 1}\)"):
        _loader.compile_check("layer_ops", names, "sm_80")


@pytest.mark.parametrize("arch", _loader.COMPILE_CHECK_ARCHS)
def test_tensor_core_prefill_layer_quant_and_lora_kernels_do_not_spill(
    arch: str, nvrtc_ok: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mma prefill holds a 16*MT x HEAD accumulator per warp in registers; a spill would put it in local
    memory on every key tile. ptxas' report (no GPU needed) must show none, at every head size and tile,
    soft-capping or not, but the one below."""
    monkeypatch.setenv("PAGEDRS_CUDA_SRC_DIR", str(CUDA_DIR))
    prefill = [
        _loader.prefill_name(ctype, head, mma=True, m_tiles=mt, soft_cap=cap)
        for ctype in ("pagedrs::half_t", "pagedrs::bf16_t")
        for head in _loader.HEAD_SIZES
        for cap in ((False, True) if head in _loader.SOFT_CAP_HEAD_SIZES else (False,))
        for mt in _loader.prefill_mma_tiles(head)
    ]
    usage = _loader.register_usage("paged_attention", prefill, arch)
    layer = _loader.register_usage("layer_ops", _loader.layer_op_names("pagedrs::bf16_t"), arch)
    assert set(usage) == set(prefill) and set(layer) == set(_loader.layer_op_names("pagedrs::bf16_t"))
    for source, names in (
        ("quant_ops", _loader.quant_op_names("pagedrs::bf16_t")),
        ("lora_ops", _loader.lora_op_names("pagedrs::bf16_t")),
        ("delta_rule", _loader.delta_rule_names("pagedrs::bf16_t")),
        # the fused experts' tensor-core GEMMs, alignment and sum (the fp32-FMA fallbacks spill a few bytes)
        ("moe_ops", tuple(n for n in _loader.moe_op_names("pagedrs::bf16_t") if not n.endswith(" false>"))),
    ):
        found = _loader.register_usage(source, names, arch)
        assert set(found) == set(names)
        layer.update(found)
    spilled = {n: u for n, u in {**usage, **layer}.items() if u[1] and not _allowed_prefill_spill(arch, n)}
    assert not spilled, f"kernels spilling registers on {arch}: {spilled}"
    assert all(regs <= 255 for regs, _ in usage.values())


def _allowed_prefill_spill(arch: str, name: str) -> bool:
    """The soft-capping 128-row tile at head 128 on sm_90 spills 12 bytes (ptxas of NVRTC 13.2; the tanh
    takes the registers the plain tile leaves)."""
    return arch == "sm_90" and name.endswith(
        (", 128, 2, pagedrs::half_t, true>", ", 128, 2, pagedrs::bf16_t, true>")
    )


# One-token decode instances where ptxas (NVRTC 13.2) spills one 8-byte stack slot, as it did before the
# kernel took several queries a request: (arch, head size, group).
_ONE_TOKEN_DECODE_SPILLS = {("sm_90", 128, 2), ("sm_80", 128, 4)}


@pytest.mark.parametrize("arch", _loader.COMPILE_CHECK_ARCHS)
def test_one_token_decode_does_not_spill(
    arch: str, nvrtc_ok: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step (what a CUDA graph captures) runs the decode and reduce kernels' one-token instances
    (MQ false): the multi-query row mapping, per-row key ranges and scratch rows fold away at compile time,
    so they keep the one-query kernel's registers. ptxas' report shows no spill for 16-bit activations and
    cache, at every head size and group but the two above; head 128 group 4 (GQA 32/8) fits 64 registers:
    8 CTAs of 128 threads per SM."""
    monkeypatch.setenv("PAGEDRS_CUDA_SRC_DIR", str(CUDA_DIR))
    ctypes = ("pagedrs::half_t", "pagedrs::bf16_t")
    decode = {
        _loader.decode_name(ctype, head, group, soft_cap=cap): (head, group)
        for ctype in ctypes
        for head in _loader.HEAD_SIZES
        for cap in ((False, True) if head in _loader.SOFT_CAP_HEAD_SIZES else (False,))
        for group in _loader.GROUP_SIZES
    }
    reduce = [_loader.reduce_name(ctype, head) for ctype in ctypes for head in _loader.HEAD_SIZES]
    usage = _loader.register_usage("paged_attention", [*decode, *reduce], arch)
    assert set(usage) == {*decode, *reduce}
    spilled = {
        n: u
        for n, u in usage.items()
        if u[1] and (arch, *decode.get(n, (0, 0))) not in _ONE_TOKEN_DECODE_SPILLS
    }
    assert not spilled, f"one-token decode kernels spilling registers on {arch}: {spilled}"
    assert all(usage[_loader.decode_name(ctype, 128, 4)][0] <= 64 for ctype in ctypes)
