"""Builds the kernels in cuda/ as host C++ (with cuda_emu.h) and runs `pagedrs.kernels` launches on them.

Usage (tests): ``with host_kernels(names): ...`` installs the emulator as pagedrs.kernels' host executor,
so the real launch wrappers run on CPU tensors. The shared library is cached by a hash of the sources
and the instantiation list.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

from pagedrs.kernels import Launch, set_host_executor

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CUDA_DIR = REPO / "cuda"


@functools.cache
def compiler() -> str | None:
    """A C++20 compiler with _Float16 (GCC >= 12 on x86-64), or None (the emulator tests skip)."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(
            "int main() { _Float16 h = static_cast<_Float16>(1.5f); return static_cast<int>(h) - 1; }\n"
        )
        proc = subprocess.run(
            [cxx, "-std=c++20", str(src), "-o", str(Path(tmp) / "probe")], capture_output=True
        )
    return cxx if proc.returncode == 0 else None


# Marks the tests that run kernels on the emulator: skipped without a suitable compiler.
needs_emulator = pytest.mark.skipif(
    compiler() is None, reason="no g++ >= 12 (C++20, _Float16) for the kernel emulator"
)


def _entries(names: Iterable[str]) -> str:
    return "".join(f'    {{"{n}", &emu::thunk<&{n}>}},\n' for n in sorted(set(names)))


_MAIN = r"""
#define PAGEDRS_EMU 1
#include "cuda_emu.h"
#include "cache_kernels.cu"
#include "paged_attention.cu"
#include "layer_ops.cu"
#include "quant_ops.cu"
#include "lora_ops.cu"
#include "moe_ops.cu"
#include "delta_rule.cu"

#include <cstdio>
#include <type_traits>
#include <utility>

namespace emu {
template <typename... A> constexpr std::size_t arity(void (*)(A...)) { return sizeof...(A); }
template <typename... A, std::size_t... I>
void call_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::decay_t<A>*>(args[I])...);
}
template <auto F> void thunk(void* p) {
    call_impl(F, static_cast<void**>(p), std::make_index_sequence<arity(F)>{});
}
}  // namespace emu

struct Entry { const char* name; void (*fn)(void*); };
static const Entry kEntries[] = {
ENTRIES};

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned long smem, void** args, char* err,
                          unsigned long errlen) {
    const Entry* e = nullptr;
    for (const Entry& x : kEntries)
        if (std::strcmp(x.name, name) == 0) e = &x;
    if (!e) { std::snprintf(err, errlen, "emulator: no instantiation %s", name); return 1; }
    if (smem > emu::kSmemBytes) { std::snprintf(err, errlen, "emulator: %lu bytes of smem", smem); return 1; }
    blockDim = dim3{bx, by, bz};
    gridDim = dim3{gx, gy, gz};
    try {
        for (unsigned z = 0; z < gz; ++z)
            for (unsigned y = 0; y < gy; ++y)
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = dim3{x, y, z};
                    std::memset(pagedrs::pg_smem, 0xff, emu::kSmemBytes);  // NaN until written
                    emu::run_cta(e->fn, args);
                }
    } catch (const std::exception& ex) {
        std::snprintf(err, errlen, "%s: %s", name, ex.what());
        return 1;
    }
    return 0;
}
"""


class Emulator:
    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        fn = self._lib.emu_launch
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_char_p,
            *([ctypes.c_uint] * 6),
            ctypes.c_ulong,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_ulong,
        ]
        self._launch = fn

    def __call__(self, spec: Launch) -> None:
        values = [np.array(a) for a in spec.args]  # 0-d arrays: addressable, exact C types
        argv = (ctypes.c_void_p * len(values))(*[v.ctypes.data for v in values])
        err = ctypes.create_string_buffer(4096)
        rc = self._launch(spec.name.encode(), *spec.grid, *spec.block, spec.shared_mem, argv, err, 4096)
        if rc:
            raise RuntimeError(err.value.decode())


def build(names: Iterable[str], *, cache_dir: Path | None = None) -> Path:
    """Compile the emulator library with these instantiations (cached)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) to build the kernel emulator")
    source = _MAIN.replace("ENTRIES", _entries(names))
    digest = hashlib.sha256()
    for part in (
        source,
        (HERE / "cuda_emu.h").read_text(),
        *(p.read_text() for p in sorted(CUDA_DIR.glob("*.cu*"))),
    ):
        digest.update(part.encode())
    out_dir = cache_dir or Path(tempfile.gettempdir()) / "pagedrs-kernel-emu"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"emu-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        src = out_dir / f"{lib.stem}.cpp"
        src.write_text(source)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [
            cxx,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-w",
            f"-I{HERE}",
            f"-I{CUDA_DIR}",
            str(src),
            "-o",
            str(tmp),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"building the kernel emulator failed:\n{proc.stderr[-8000:]}")
        tmp.replace(lib)
    return lib


@contextlib.contextmanager
def host_kernels(names: Iterable[str]) -> Iterator[Emulator]:
    """Run pagedrs.kernels launches on CPU tensors through the emulator, inside the block."""
    emulator = Emulator(build(names))
    previous = set_host_executor(emulator)
    try:
        yield emulator
    finally:
        set_host_executor(previous)


@contextlib.contextmanager
def recording_kernels(names: Iterable[str]) -> Iterator[list[str]]:
    """host_kernels, also yielding the name expressions of the kernels launched ("pagedrs::rms_norm<float,
    4>", ...), appended as they run."""
    seen: list[str] = []
    with host_kernels(names) as emulator:

        def record(spec: Launch) -> None:
            seen.append(spec.name)
            emulator(spec)

        previous = set_host_executor(record)
        try:
            yield seen
        finally:
            set_host_executor(previous)
