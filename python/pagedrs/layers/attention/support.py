"""Which attention kernel takes which layer: the one table the backends and the selector read, below
both (a layer a kernel does not take runs on the torch reference)."""

from __future__ import annotations

__all__ = ["kernel_takes"]


def kernel_takes(kernel: str, *, head_size: int, logits_soft_cap: float | None, sinks: bool = False) -> bool:
    """Whether `kernel` computes a layer of this head size and attention-logit soft cap: "cupy" (the CUDA
    paged attention of `pagedrs.kernels`) or "cpu_decode" (the Rust decode kernel inside the torch
    backend). A layer a kernel does not take runs on the torch reference instead. The one place to
    update when a kernel gains a head size, soft-capping or attention sinks (only the CPU kernel takes
    sinks)."""
    if kernel == "cupy":
        from pagedrs.kernels import HEAD_SIZES, SOFT_CAP_HEAD_SIZES

        return not sinks and head_size in (HEAD_SIZES if logits_soft_cap is None else SOFT_CAP_HEAD_SIZES)
    return True  # the Rust CPU decode kernel takes any head size, soft-capping and sinks
