"""CUDA kernels from `cuda/`, compiled at run time through CuPy (NVRTC) and launched on torch's stream.

- `reshape_and_cache`, `copy_blocks` (cuda/cache_kernels.cu)
- `paged_attention`: decode (split-K, up to DECODE_MAX_QUERY query tokens per request) + varlen prefill
  (tensor cores on sm_80+) (cuda/paged_attention.cu)
- `compile_check`, `instantiation_groups`: compile every instantiation with NVRTC, no GPU needed
"""

from pagedrs.kernels._launch import Launch, set_host_executor
from pagedrs.kernels._loader import (
    COMPILE_CHECK_ARCHS,
    HEAD_SIZES,
    SOFT_CAP_HEAD_SIZES,
    KernelCompileError,
    compile_check,
    instantiation_groups,
    kernel_source,
    nvrtc_version,
)
from pagedrs.kernels.attention_ops import decode_partitions, paged_attention, supports
from pagedrs.kernels.cache_ops import copy_blocks, reshape_and_cache

__all__ = [
    "COMPILE_CHECK_ARCHS",
    "HEAD_SIZES",
    "KernelCompileError",
    "SOFT_CAP_HEAD_SIZES",
    "Launch",
    "compile_check",
    "copy_blocks",
    "decode_partitions",
    "instantiation_groups",
    "kernel_source",
    "nvrtc_version",
    "paged_attention",
    "reshape_and_cache",
    "set_host_executor",
    "supports",
]
