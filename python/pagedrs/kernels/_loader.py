"""Kernel sources, their template instantiations, the cached CuPy loader and an NVRTC compile check.

Sources come from the extension (`pagedrs._core.kernel_source`), so a wheel runs exactly the kernels it
was built with. Setting ``PAGEDRS_CUDA_SRC_DIR`` to a folder of ``NAME.cu`` files (and the headers they
include) reads those instead (kernel development without rebuilding the extension).

The kernels include no CUDA header; their own header (cuda/common.cuh) is inlined by `kernel_source`, so
NVRTC needs no include directory: the NVRTC library alone
(pip: ``nvidia-cuda-nvrtc-cu12`` or ``nvidia-cuda-nvrtc`` 13, found through CuPy's cuda-pathfinder)
compiles them, with or without a GPU.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_CTYPES",
    "COMPILE_CHECK_ARCHS",
    "CTYPES",
    "GROUP_SIZES",
    "ACTIVATIONS",
    "HEADERS",
    "HEAD_SIZES",
    "KernelCompileError",
    "NVRTC_OPTIONS",
    "PREFILL_MMA_TILES",
    "SOFT_CAP_HEAD_SIZES",
    "SOURCES",
    "WORD_TYPES",
    "attention_names",
    "cache_names",
    "compile_check",
    "delta_rule_names",
    "get_kernel",
    "instantiation_groups",
    "kernel_source",
    "layer_op_names",
    "lora_op_names",
    "moe_op_names",
    "nvrtc_version",
    "prefill_mma_tiles",
    "quant_op_names",
    "register_usage",
    "vector_width",
]

SOURCES = ("cache_kernels", "paged_attention", "layer_ops", "quant_ops", "lora_ops", "moe_ops", "delta_rule")
HEADERS = ("common.cuh",)  # included by the sources, inlined by kernel_source
HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)
# Head sizes with soft-capping instances (Gemma 2's checkpoints: 256 for 2b and 9b, 128 for 27b); kept
# to these so the compile check stays short (any head size would compile: CAP is a template argument).
SOFT_CAP_HEAD_SIZES = (128, 256)
# Query heads per decode CTA: the group size G = num_heads / num_kv_heads rounded up to one of these
# (larger groups take ceil(G / 8) CTAs per kv head).
GROUP_SIZES = (1, 2, 4, 8)
CTYPES = {"float16": "pagedrs::half_t", "bfloat16": "pagedrs::bf16_t", "float32": "float"}
# fp8 KV caches (kv_cache_dtype fp8 / fp8_e5m2), read by the decode and both prefill kernels
CACHE_CTYPES = {"float8_e4m3fn": "pagedrs::fp8e4m3_t", "float8_e5m2": "pagedrs::fp8e5m2_t"}
WORD_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
NVRTC_OPTIONS = ("-std=c++17",)
# What CuPy's RawModule adds to NVRTC_OPTIONS (besides -arch); the compile check mirrors it.
_CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
COMPILE_CHECK_ARCHS = ("sm_80", "sm_90")

_NVRTC_HINT = (
    "NVRTC is needed to compile the CUDA kernels: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12 "
    "(or cupy-cuda13x with nvidia-cuda-nvrtc 13)"
)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries NVRTC's log."""


def _raw_source(file: str) -> str:
    src_dir = os.environ.get("PAGEDRS_CUDA_SRC_DIR")
    if src_dir:
        return (Path(src_dir) / file).read_text()
    from pagedrs._core import kernel_source as embedded

    return embedded(file.removesuffix(".cu"))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+)"\s*$')


def kernel_source(name: str) -> str:
    """The CUDA source `name` (see SOURCES), with its `#include "common.cuh"` lines replaced by the header
    (once each), followed by a #line directive so NVRTC's messages keep the file's own line numbers."""
    lines = _raw_source(f"{name}.cu").splitlines()
    out: list[str] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        match = _INCLUDE.match(line)
        if match is None:
            out.append(line)
            continue
        header = match.group(1)
        if header not in HEADERS:
            raise KernelCompileError(f"cuda/{name}.cu:{number} includes {header!r}, not one of {HEADERS}")
        if header not in seen:
            seen.add(header)
            out.append(_raw_source(header))
            out.append(f'#line {number + 1} "cuda/{name}.cu"')
    return "\n".join(out) + "\n"


def cache_names() -> tuple[str, ...]:
    """Every instantiation in cache_kernels.cu (one per copy word; dtype-agnostic)."""
    words = WORD_TYPES.values()
    return tuple(f"pagedrs::reshape_and_cache<{w}>" for w in words) + tuple(
        f"pagedrs::copy_blocks<{w}>" for w in words
    )


def _cache_arg(cache_ctype: str | None) -> str:
    return f", {cache_ctype}" if cache_ctype is not None else ""


def decode_name(
    ctype: str,
    head_size: int,
    group: int,
    cache_ctype: str | None = None,
    *,
    multi_query: bool = False,
    soft_cap: bool = False,
) -> str:
    """The decode instance for one query per request (multi_query False: the kernel's MQ = false, its
    one-token code) or for several (speculative verification); soft_cap: the one capping the logits
    (CAP = true; the others are named as before the kernel had that template argument)."""
    if soft_cap:
        mq = "true" if multi_query else "false"
        return f"pagedrs::paged_attention_decode<{ctype}, {head_size}, {group}, {cache_ctype or ctype}, {mq}, true>"
    if multi_query:
        return f"pagedrs::paged_attention_decode<{ctype}, {head_size}, {group}, {cache_ctype or ctype}, true>"
    return f"pagedrs::paged_attention_decode<{ctype}, {head_size}, {group}{_cache_arg(cache_ctype)}>"


def reduce_name(ctype: str, head_size: int, *, multi_query: bool = False) -> str:
    return f"pagedrs::paged_attention_reduce<{ctype}, {head_size}{', true' if multi_query else ''}>"


def _decode_names(ctype: str, head_size: int, cache_ctype: str | None, soft_cap: bool) -> list[str]:
    """Decode and the split-K reduction, one-token instances (every group size) and multi-query ones (the
    group sizes past 1: a request of 2+ queries brings 2+ rows per kv head, attention_ops.decode_rows)."""
    names = [decode_name(ctype, head_size, g, cache_ctype, soft_cap=soft_cap) for g in GROUP_SIZES]
    names.append(reduce_name(ctype, head_size))
    names += [
        decode_name(ctype, head_size, g, cache_ctype, multi_query=True, soft_cap=soft_cap)
        for g in GROUP_SIZES
        if g > 1
    ]
    names.append(reduce_name(ctype, head_size, multi_query=True))
    return names


# Tensor-core prefill: 16 rows per warp (64 per CTA) or 32 (128 per CTA, FlashAttention-2's tile)
PREFILL_MMA_TILES = (1, 2)


def prefill_mma_tiles(head_size: int) -> tuple[int, ...]:
    """The tensor-core prefill's tiles for a head size: head 256 takes 16 rows per warp only (a 32 x 256
    accumulator would not fit a thread's 255 registers)."""
    return (1,) if head_size > 128 else PREFILL_MMA_TILES


def prefill_name(
    ctype: str,
    head_size: int,
    *,
    mma: bool,
    cache_ctype: str | None = None,
    m_tiles: int = 1,
    soft_cap: bool = False,
) -> str:
    if soft_cap:
        tile = f"{m_tiles}, " if mma else ""
        kernel = "paged_attention_prefill" if mma else "paged_attention_prefill_scalar"
        return f"pagedrs::{kernel}<{ctype}, {head_size}, {tile}{cache_ctype or ctype}, true>"
    if mma:
        return f"pagedrs::paged_attention_prefill<{ctype}, {head_size}, {m_tiles}{_cache_arg(cache_ctype)}>"
    return f"pagedrs::paged_attention_prefill_scalar<{ctype}, {head_size}{_cache_arg(cache_ctype)}>"


def fp8_write_name(ctype: str, cache_ctype: str) -> str:
    return f"pagedrs::reshape_and_cache_fp8<{ctype}, {cache_ctype}>"


def attention_names(
    ctype: str, head_size: int, cache_ctype: str | None = None, *, soft_cap: bool = False
) -> tuple[str, ...]:
    """The instantiations one model needs (one dtype, one head size), compiled together as one module:
    decode for every group size and the split-K reduction (one-token and multi-query instances), and the
    prefill kernels (tensor-core for 16-bit types, scalar for all: fp32, and fp16/bf16 before sm_80).
    With an fp8 cache (`cache_ctype`, one of CACHE_CTYPES): the same kernels reading it (tensor-core
    prefill for 16-bit activations) and the converting cache write. `soft_cap`: the instances that
    soft-cap the logits (a model such as Gemma 2 runs only those; a module of its own, without the cache
    write, which stays in the plain module)."""
    names = _decode_names(ctype, head_size, cache_ctype, soft_cap)
    mma = [
        prefill_name(ctype, head_size, mma=True, cache_ctype=cache_ctype, m_tiles=mt, soft_cap=soft_cap)
        for mt in prefill_mma_tiles(head_size)
    ]
    names += mma if ctype != "float" else []
    names.append(prefill_name(ctype, head_size, mma=False, cache_ctype=cache_ctype, soft_cap=soft_cap))
    if cache_ctype is not None and not soft_cap:  # launch_fp8_write loads the plain module
        names.append(fp8_write_name(ctype, cache_ctype))
    return tuple(names)


# Gated activations of act_and_mul (cuda/layer_ops.cu): name -> its ACT template argument
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def vector_width(ctype: str) -> int:
    """Elements per 16-byte access for a kernel element type."""
    return 4 if ctype == "float" else 8


def layer_op_names(ctype: str) -> tuple[str, ...]:
    """Every instantiation of cuda/layer_ops.cu for one dtype (one module): the norms and activations with
    16-byte vectors and with scalar accesses, rotary embedding in both layouts."""
    names: list[str] = []
    for vec in (vector_width(ctype), 1):
        names.append(f"pagedrs::rms_norm<{ctype}, {vec}>")
        names.append(f"pagedrs::fused_add_rms_norm<{ctype}, {vec}>")
        names += [f"pagedrs::act_and_mul<{ctype}, {vec}, {a}>" for a in ACTIVATIONS.values()]
    names += [f"pagedrs::rotary_embedding<{ctype}, {neox}>" for neox in ("true", "false")]
    return tuple(names)


def quant_op_names(ctype: str) -> tuple[str, ...]:
    """Every instantiation of cuda/quant_ops.cu for one output dtype (one module): GPTQ at 2, 4 and 8 bits
    (quant_ops.GPTQ_BITS) and AWQ, each with scales in any of the three float dtypes."""
    names: list[str] = []
    for scale_ctype in CTYPES.values():
        names += [f"pagedrs::dequantize_gptq<{ctype}, {scale_ctype}, {bits}>" for bits in (2, 4, 8)]
        names.append(f"pagedrs::dequantize_awq<{ctype}, {scale_ctype}>")
    return tuple(names)


def lora_op_names(ctype: str) -> tuple[str, ...]:
    """Every instantiation of cuda/lora_ops.cu for one dtype (one module): the shrink and the expand, each
    with 16-byte vectors and with scalar accesses."""
    vecs = (vector_width(ctype), 1)
    return tuple(f"pagedrs::lora_{op}<{ctype}, {vec}>" for op in ("shrink", "expand") for vec in vecs)


def delta_rule_names(ctype: str) -> tuple[str, ...]:
    """Every instantiation of cuda/delta_rule.cu for one dtype (one module): the Gated DeltaNet decode step's
    conv update and recurrent update."""
    return (f"pagedrs::gdn_conv_update<{ctype}>", f"pagedrs::gdn_recurrent<{ctype}>")


# Fused experts (cuda/moe_ops.cu): weight forms (WF), activations (ACT) and row tiles (BM)
MOE_WEIGHT_FORMS = {"dense": 0, "q8_0": 1, "fp8": 2}
MOE_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swiglu_oai": 3}
MOE_BLOCK_MS = (16, 64)


def moe_op_names(ctype: str) -> tuple[str, ...]:
    """Every instantiation of cuda/moe_ops.cu for one dtype (one module): the alignment step, gate/up with
    every activation and down for every weight form and row tile (tensor-core and fp32-FMA instances for
    16-bit types), and the per-token sum."""
    names = ["pagedrs::moe_align", f"pagedrs::moe_sum<{ctype}>"]
    for mma in ("false",) if ctype == "float" else ("true", "false"):  # tensor cores: 16-bit types
        for wf in MOE_WEIGHT_FORMS.values():
            for bm in MOE_BLOCK_MS:
                acts = MOE_ACTIVATIONS.values()
                names += [f"pagedrs::moe_gate_up<{ctype}, {wf}, {a}, {bm}, {mma}>" for a in acts]
                names.append(f"pagedrs::moe_down<{ctype}, {wf}, {bm}, {mma}>")
    return tuple(names)


def instantiation_groups() -> list[tuple[str, tuple[str, ...]]]:
    """Every (source, names) module the package can load; together: every instantiation."""
    groups: list[tuple[str, tuple[str, ...]]] = [("cache_kernels", cache_names())]
    groups += [("layer_ops", layer_op_names(ctype)) for ctype in CTYPES.values()]
    groups += [("quant_ops", quant_op_names(ctype)) for ctype in CTYPES.values()]
    groups += [("lora_ops", lora_op_names(ctype)) for ctype in CTYPES.values()]
    groups += [("moe_ops", moe_op_names(ctype)) for ctype in CTYPES.values()]
    groups += [("delta_rule", delta_rule_names(ctype)) for ctype in CTYPES.values()]
    for ctype in CTYPES.values():
        for head_size in HEAD_SIZES:
            for cache_ctype in (None, *CACHE_CTYPES.values()):
                for soft_cap in (False, True) if head_size in SOFT_CAP_HEAD_SIZES else (False,):
                    names = attention_names(ctype, head_size, cache_ctype, soft_cap=soft_cap)
                    groups.append(("paged_attention", names))
    return groups


# ---- run time (CuPy) --------------------------------------------------------------------------------------
@functools.cache
def _module(source: str, names: tuple[str, ...], device_index: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=kernel_source(source), options=NVRTC_OPTIONS, name_expressions=list(names))


@functools.cache
def get_kernel(source: str, names: tuple[str, ...], name: str, device_index: int) -> Any:
    """The cupy.RawKernel `name` from the module of `names` (compiled once per process and device; CuPy
    also keeps the binary in its on-disk cache across processes)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return _module(source, names, device_index).get_function(name)


# ---- compile check (NVRTC only, no GPU) ------------------------------------------------------------------
def _nvrtc() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(_NVRTC_HINT) from e
    try:
        nvrtc.getVersion()
    except Exception as e:  # libnvrtc not found
        raise ImportError(f"{_NVRTC_HINT} ({e})") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    major, minor = _nvrtc().getVersion()
    return int(major), int(minor)


def _compile(
    source: str, names: Sequence[str], arch: str, code: str | None, extra: Sequence[str] = ()
) -> tuple[dict[str, str], str]:
    nvrtc = _nvrtc()
    text = kernel_source(source) if code is None else code
    prog = nvrtc.createProgram(text, f"{source}.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, *_CUPY_ADDED_OPTIONS, f"-arch={arch}", *extra])
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"{source}.cu for {arch}: {e}\n{log}") from e
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        # a virtual arch (compute_XY) stops at PTX: the front end without ptxas
        output = nvrtc.getPTX(prog) if arch.startswith("compute_") else nvrtc.getCUBIN(prog)
        if not output:
            raise KernelCompileError(f"{source}.cu for {arch}: NVRTC produced no output")
        return lowered, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_check(source: str, names: Sequence[str], arch: str, *, code: str | None = None) -> dict[str, str]:
    """Compile `names` of `source` to a cubin for `arch` (e.g. "sm_80") with NVRTC, without a GPU; a
    virtual `arch` ("compute_90") compiles to PTX only (every template through the front end, no ptxas).

    Returns each name expression's lowered (mangled) name. Raises KernelCompileError with NVRTC's log."""
    return _compile(source, names, arch, code)[0]


def register_usage(
    source: str, names: Sequence[str], arch: str, *, code: str | None = None
) -> dict[str, tuple[int, int]]:
    """(registers per thread, spilled bytes stored) of each instantiation, from ptxas' report for `arch`:
    what a kernel's occupancy and local-memory traffic will be, known without a GPU."""
    lowered, log = _compile(source, names, arch, code, ("--ptxas-options=-v",))
    by_mangled = {m: n for n, m in lowered.items()}
    usage: dict[str, tuple[int, int]] = {}
    current: str | None = None
    spills = 0
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            current, spills = by_mangled.get(entry.group(1)), 0
            continue
        spill = re.search(r"(\d+) bytes spill stores", line)
        if spill:
            spills = int(spill.group(1))
        regs = re.search(r"Used (\d+) registers", line)
        if regs and current is not None:
            usage[current] = (int(regs.group(1)), spills)
    return usage
