"""CUDA graphs for decode-only steps.

A decode step launches hundreds of small kernels; replaying a captured graph costs one launch. A graph is
captured per (padded batch size, context bucket): the batch is padded to the next capture size, and the
decode kernel's split-K grid is sized for the bucket (512 * 4^k keys, up to the capacity), so short
contexts do not pay for the longest one. Graphs are captured lazily on first use (or all at once with
`capture_all`) into one shared memory pool.

Inputs go through static buffers. Padding rows get seq_len 0 (zero attention output) and slot -1 (no
cache write), so they never touch the cache; their outputs are discarded.

Only backends whose launches depend on host integers alone (not on per-request host lists) can be
captured: the "cupy" backend. A model whose forward synchronizes with the host (e.g. dynamic RoPE
scaling) fails to capture; the runner then logs once and returns None, and the caller runs eagerly.

Use from the model runner (after the KV pool exists; not with enforce_eager)::

    if device.type == "cuda" and not enforce_eager and backend.name == "cupy":
        graphs = CudaGraphRunner(model, pool.kv_caches, backend, max_batch_size=min(max_num_seqs, 512),
                                 max_blocks_per_seq=ceil(max_model_len / block_size), block_size=block_size)
    ...
    hidden = graphs.run(input_ids, positions, meta, pool.kv_caches) if graphs else None  # per step
    if hidden is None:
        hidden = model(input_ids, positions, ctx)

Passing the pool's current caches lets the runner notice a reallocated pool and recapture.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from pagedrs.layers.attention import AttentionBackend, AttentionMetadata, ForwardContext

__all__ = ["CudaGraphRunner", "default_capture_sizes"]

logger = logging.getLogger(__name__)

_MIN_BUCKET = 512  # decode contexts up to this run in one partition


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch_size."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted({*sizes, max_batch_size})


class CudaGraphRunner:
    """Captures and replays `model(input_ids, positions, ctx)` for decode-only batches.

    The returned hidden states are a view of the graph's static output: use them (compute logits) before
    the next `run`."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: Sequence[Tensor],
        backend: AttentionBackend,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        capture_sizes: Sequence[int] | None = None,
    ) -> None:
        if getattr(backend, "name", None) != "cupy":
            raise ValueError(
                f"CUDA graphs need the 'cupy' attention backend, got {getattr(backend, 'name', backend)!r}"
            )
        if not kv_caches or kv_caches[0].device.type != "cuda":
            raise ValueError("CUDA graphs need KV caches on a CUDA device")
        if max_batch_size < 1 or max_blocks_per_seq < 1:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) and max_blocks_per_seq ({max_blocks_per_seq}) "
                "must be positive"
            )
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capture_sizes = sorted(set(capture_sizes or default_capture_sizes(max_batch_size)))
        self.max_batch_size = self.capture_sizes[-1]
        capacity = max_blocks_per_seq * block_size
        self.buckets = [min(_MIN_BUCKET, capacity)]
        while self.buckets[-1] < capacity:
            self.buckets.append(min(self.buckets[-1] * 4, capacity))
        self.device = kv_caches[0].device
        n, dev = self.max_batch_size, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one token each, fixed
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.enabled = True
        self._stream = torch.cuda.Stream(self.device)
        self._pool: object | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._kv_caches: list[Tensor] = []
        self._kv_ptrs: tuple[int, ...] = ()
        self.reset(kv_caches)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def reset(self, kv_caches: Sequence[Tensor]) -> None:
        """Drop every graph (they hold the old caches' addresses); call after the pool is reallocated.
        `run` does this by itself when it sees other cache tensors."""
        self._graphs.clear()
        self._pool = None
        self._kv_caches = list(kv_caches)
        self._kv_ptrs = tuple(c.data_ptr() for c in kv_caches)

    def capture_all(self) -> None:
        """Capture every (size, bucket) now, largest first (so smaller graphs reuse the pool)."""
        for bucket in reversed(self.buckets):
            for size in reversed(self.capture_sizes):
                if self.enabled and (size, bucket) not in self._graphs:
                    self._capture(size, bucket)

    def _meta(self, size: int, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[bucket] * size,  # upper bounds; the kernels read the device values
            max_query_len=1,
            max_seq_len=bucket,
            block_size=self.block_size,
            num_decode_tokens=size,
        )

    def _forward(self, size: int, bucket: int) -> Tensor:
        # A fresh metadata object each time: nothing a layer caches in meta.cache during the warm-up
        # may stand in for work the graph must redo at every replay.
        ctx = ForwardContext(
            attn_metadata=self._meta(size, bucket), kv_caches=self._kv_caches, backend=self.backend
        )
        return self.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def _capture(self, size: int, bucket: int) -> bool:
        # Padding state: every row is padding (no cache writes, zero attention), so warm-up and capture
        # leave the KV cache untouched.
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        try:
            # Warm up on the capture stream itself: kernels compile and load, cuBLAS sets up its
            # workspace, and the CuPy wrapper of this stream exists before capture begins.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._forward(size, bucket)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                out = self._forward(size, bucket)
        except Exception as e:  # a host sync or an uncapturable op in the model
            self.enabled = False
            logger.warning(
                "CUDA graph capture failed (batch %d, context %d): %s; running eagerly", size, bucket, e
            )
            return False
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(size, bucket)] = (graph, out)
        return True

    # ---- one step -------------------------------------------------------------------------------------
    def run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[Tensor] | None = None,
    ) -> Tensor | None:
        """Hidden states [n, hidden] of a decode-only step by graph replay, or None when the step cannot
        use a graph (not decode-only, too large a batch or block table, graphs disabled): run eagerly."""
        n = input_ids.shape[0]
        if (
            not self.enabled
            or meta.max_query_len != 1
            or n == 0
            or n > self.max_batch_size
            or meta.seq_lens.shape[0] != n
            or meta.block_tables.shape[1] > self.max_blocks_per_seq
            or meta.max_seq_len > self.buckets[-1]
        ):
            return None
        if kv_caches is not None and tuple(c.data_ptr() for c in kv_caches) != self._kv_ptrs:
            self.reset(kv_caches)
        size = next(s for s in self.capture_sizes if s >= n)
        bucket = next(b for b in self.buckets if b >= meta.max_seq_len)
        entry = self._graphs.get((size, bucket))
        if entry is None:
            if not self._capture(size, bucket):
                return None
            entry = self._graphs[(size, bucket)]
        graph, out = entry
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep older rows' blocks: never read, seq_lens bounds every read.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        graph.replay()
        return out[:n]
