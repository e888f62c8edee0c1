"""The batch-1 decode roofline on a CPU: the bytes one token's forward must read (every weight matrix of a
GGUF file once; a tied embedding counted once, as the LM head reads it whole; an untied one not at all, as
a step gathers one row) over the read bandwidth measured here (a float32 sum over 512 MiB with the given
threads, best of 5). KV reads, norms and activations are left out: a few hundred KiB at 64-token contexts.
"""

from __future__ import annotations

import time
from typing import Any


def weight_bytes_per_token(path: str) -> int:
    from pagedrs.loader.gguf_reader import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    tied = "output.weight" not in tensors
    total = 0
    for name, t in tensors.items():
        if len(t.shape) < 2 or (name == "token_embd.weight" and not tied):
            continue
        total += int(t.n_bytes)
    return total


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second that `threads` threads read (torch's sum over a float32 buffer, best of `repeats`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(x.sum())
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def roofline(path: str, threads: int) -> dict[str, Any]:
    nbytes = weight_bytes_per_token(path)
    bw = read_bandwidth(threads)
    return {"bytes_per_token": nbytes, "read_bandwidth_gbs": bw / 1e9, "roofline_tpot_ms": nbytes / bw * 1e3}
