"""CUDA graphs for decode-only steps, captured at start-up.

A decode step launches hundreds of small kernels; replaying a captured graph costs one launch. A graph is
captured per (padded batch size, context bucket): the batch is padded to the next capture size, and the
decode kernel's split-K grid is sized for the bucket (512 * 4^k keys, up to the capacity), so short
contexts do not pay for the longest one. The model runner captures every pair when the engine starts
(`capture_all`, largest first so that smaller graphs reuse the memory pool), never inside a request:
with the default capture sizes (1, 2, 4, 8, 16, 32, ..., 256 for max_num_seqs 256: 20 sizes) and
max_model_len 4096 (buckets 512, 2048, 4096) or 8192 (512, 2048, 8192) that is 3 x 20 = 60 graphs;
each bucket more (32768, 131072) adds 20. A pair is captured lazily only after the KV pool was
reallocated (a resize drops every graph).

Inputs are static buffers: the model runner packs each step straight into them (`StepBuffers`, one
host-to-device copy) and fills the graph's block table from its device mirror; standalone use (`run`)
copies them in. Padding rows get seq_len 0 (zero attention output) and slot -1 (no cache write), so they
never touch the cache. The graph ends by copying the hidden states into one static output buffer: the
tensors of one graph are dead once it is captured, so every graph reuses the pool's memory and the pool
is about as large as the largest graph's activations, plus the driver's per-graph memory.

Memory (`profile_memory`, what vLLM V1's `profile_cudagraph_memory` does): before the KV pool is sized,
capture the two largest graphs against a small throwaway pool; the first costs the shared pool, the
second one graph's own share (at least 1 MiB). estimate = first + second * (num_graphs - 1), and the KV
pool is sized that much smaller (`estimate_graph_memory`).

Only backends whose launches depend on host integers alone (not on per-request host lists) can be
captured: the "cupy" backend. A model whose forward synchronizes with the host (e.g. dynamic RoPE
scaling) fails to capture; the runner then logs once, disables graphs and the caller runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pagedrs.layers.attention import AttentionBackend, AttentionMetadata, ForwardContext
from pagedrs.models.interface import CausalLM
from pagedrs.runner.step_buffers import GraphInputs

__all__ = [
    "CudaGraphRunner",
    "capture_order",
    "context_buckets",
    "default_capture_sizes",
    "estimate_graph_memory",
]

logger = logging.getLogger(__name__)

_MIN_BUCKET = 512  # the smallest context bucket (keys); a bucket sets the decode split-K grid
_MIB = 1 << 20
_GIB = 1 << 30


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch_size."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted({*sizes, max_batch_size})


def context_buckets(capacity: int) -> list[int]:
    """512, 2048, 8192, ... keys (x4 each), the last one clipped to the capacity."""
    buckets = [min(_MIN_BUCKET, capacity)]
    while buckets[-1] < capacity:
        buckets.append(min(buckets[-1] * 4, capacity))
    return buckets


def capture_order(sizes: Sequence[int], buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (size, bucket) pair, the largest graphs first."""
    return [(s, b) for b in sorted(buckets, reverse=True) for s in sorted(sizes, reverse=True)]


def estimate_graph_memory(first: int, second: int | None, num_graphs: int) -> int:
    """Bytes the captured graphs will hold: the first (largest) capture's cost, then each other graph
    costs what the second capture did, at least 1 MiB (vLLM's estimate)."""
    if num_graphs <= 0:
        return 0
    return max(first, 0) + max(second or 0, _MIB) * (num_graphs - 1)


class CudaGraphRunner:
    """Captures and replays `model(input_ids, positions, ctx)` for decode-only batches.

    The hidden states a replay returns are a view of the static output: use them (compute logits) before
    the next replay."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: Sequence[Tensor],
        backend: AttentionBackend,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        capture_sizes: Sequence[int] | None = None,
        inputs: GraphInputs | None = None,
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
        self.buckets = context_buckets(max_blocks_per_seq * block_size)
        self.device = kv_caches[0].device
        n, dev = self.max_batch_size, self.device
        if inputs is None:  # standalone: own static inputs, filled by `run`
            inputs = GraphInputs(
                input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
                positions=torch.zeros(n, dtype=torch.int64, device=dev),
                slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
                seq_lens=torch.zeros(n, dtype=torch.int32, device=dev),
                query_start_loc=torch.zeros(n + 1, dtype=torch.int32, device=dev),
                block_table_rows=torch.zeros(n, dtype=torch.int64, device=dev),
            )
        elif inputs.input_ids.shape[0] < n:
            raise ValueError(f"graph inputs hold {inputs.input_ids.shape[0]} rows, need {n}")
        self.inputs = inputs
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)  # decode-only: one token a row
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.output: Tensor | None = None  # [max_batch_size, hidden], allocated at the first capture
        self.enabled = True
        self.num_captures = 0
        self.num_replays = 0
        self.captured_bytes = 0  # device memory the last capture_all took
        self._stream = torch.cuda.Stream(self.device)
        self._pool: Any = None  # torch.cuda.graph_pool_handle(): an opaque handle
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._kv_caches: Sequence[Tensor] = ()  # as given: a step passing the same list skips the check
        self.reset(kv_caches)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Every (size, bucket) graph, in capture order."""
        return capture_order(self.capture_sizes, self.buckets)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def reset(self, kv_caches: Sequence[Tensor]) -> None:
        """Drop every graph (they hold the old caches' addresses); call after the pool is reallocated.
        `lookup` does this by itself when it is given other cache tensors."""
        self._graphs.clear()
        self._pool = None
        self._kv_caches = kv_caches

    def capture_all(self, *, progress: bool = True) -> None:
        """Capture every (size, bucket) now, largest first; log how long it took and what it cost."""
        from tqdm import tqdm

        pairs = [p for p in self.pairs if p not in self._graphs]
        if not self.enabled or not pairs:
            return
        logger.info(
            "Capturing %d CUDA graphs for decode steps: %d batch sizes (%d..%d) x %d context buckets (%s)",
            len(pairs),
            len(self.capture_sizes),
            self.capture_sizes[0],
            self.max_batch_size,
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
        )
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for size, bucket in tqdm(pairs, desc="Capturing CUDA graphs (decode)", disable=not progress):
            if not self._capture(size, bucket):
                return
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.captured_bytes = used
        logger.info(
            "Captured %d CUDA graphs in %.1f s, %.2f GiB",
            len(pairs),
            time.perf_counter() - start,
            used / _GIB,
        )

    def profile_memory(self) -> int:
        """Capture the two largest graphs, drop them, and return the estimate of what all of them will
        hold (0 if the model cannot be captured: `enabled` is then False)."""
        dev = self.device
        pairs = self.pairs
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        samples: list[int] = []
        for size, bucket in pairs[:2]:
            before = torch.cuda.mem_get_info(dev)[0]
            if not self._capture(size, bucket):
                break
            torch.cuda.synchronize(dev)
            samples.append(before - torch.cuda.mem_get_info(dev)[0])
        self.reset(self._kv_caches)
        if not self.enabled or not samples:
            return 0
        estimate = estimate_graph_memory(samples[0], samples[1] if len(samples) > 1 else None, len(pairs))
        estimate += self.block_tables.nbytes  # allocated with the runner, before any capture
        logger.info(
            "CUDA graph memory: %.1f MiB for the first graph, %.1f MiB each next one; %d graphs: %.2f GiB "
            "kept out of the KV cache",
            samples[0] / _MIB,
            (samples[1] if len(samples) > 1 else 0) / _MIB,
            len(pairs),
            estimate / _GIB,
        )
        return estimate

    def _meta(self, size: int, bucket: int) -> AttentionMetadata:
        inp = self.inputs
        return AttentionMetadata(
            slot_mapping=inp.slot_mapping[:size],
            query_start_loc=inp.query_start_loc[: size + 1],
            seq_lens=inp.seq_lens[:size],
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
            attn_metadata=self._meta(size, bucket), kv_caches=list(self._kv_caches), backend=self.backend
        )
        return self.model(self.inputs.input_ids[:size], self.inputs.positions[:size], ctx)

    @torch.inference_mode()
    def _capture(self, size: int, bucket: int) -> bool:
        # Padding state: every row is padding (no cache writes, zero attention), so warm-up and capture
        # leave the KV cache untouched.
        inp = self.inputs
        inp.input_ids[:size].zero_()
        inp.positions[:size].zero_()
        inp.slot_mapping[:size].fill_(-1)
        inp.seq_lens[:size].zero_()
        inp.query_start_loc[: size + 1].copy_(self._qsl[: size + 1])
        try:
            # Warm up on the capture stream itself: kernels compile and load, cuBLAS sets up its
            # workspace, and the CuPy wrapper of this stream exists before capture begins.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                hidden = self._forward(size, bucket)
            torch.cuda.synchronize(self.device)
            if self.output is None:
                self.output = torch.empty(
                    (self.max_batch_size, hidden.shape[-1]), dtype=hidden.dtype, device=self.device
                )
            del hidden
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                self.output[:size].copy_(self._forward(size, bucket))
        except Exception as e:  # a host sync or an uncapturable op in the model
            self.enabled = False
            self._graphs.clear()
            logger.warning(
                "CUDA graph capture failed (batch %d, context %d): %s; running eagerly", size, bucket, e
            )
            return False
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(size, bucket)] = graph
        self.num_captures += 1
        return True

    # ---- one step -------------------------------------------------------------------------------------
    def lookup(
        self, num_reqs: int, max_query_len: int, max_seq_len: int, kv_caches: Sequence[Tensor]
    ) -> tuple[int, int] | None:
        """The (size, bucket) graph that replays a step, or None when it must run eagerly (not
        decode-only, too large a batch or context, graphs disabled). Call before writing the inputs:
        a missing graph (after a pool reallocation) is captured here."""
        if (
            not self.enabled
            or max_query_len != 1
            or num_reqs == 0
            or num_reqs > self.max_batch_size
            or max_seq_len > self.buckets[-1]
        ):
            return None
        if kv_caches is not self._kv_caches:
            if len(kv_caches) != len(self._kv_caches) or any(
                a.data_ptr() != b.data_ptr() for a, b in zip(kv_caches, self._kv_caches, strict=True)
            ):
                logger.info("KV pool reallocated: CUDA graphs are captured again as they are needed")
                self.reset(kv_caches)
            self._kv_caches = kv_caches
        size = self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_reqs)]
        bucket = self.buckets[bisect.bisect_left(self.buckets, max_seq_len)]
        if (size, bucket) not in self._graphs and not self._capture(size, bucket):
            return None
        return size, bucket

    def replay(self, key: tuple[int, int]) -> Tensor:
        """Replay graph `key` over the static inputs (rows [0, size)); returns output rows [0, size)."""
        self._graphs[key].replay()
        self.num_replays += 1
        assert self.output is not None
        return self.output[: key[0]]

    def run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[Tensor] | None = None,
    ) -> Tensor | None:
        """Standalone use: hidden states [n, hidden] of a decode-only step by graph replay, its inputs
        copied into the static buffers; None when the step cannot use a graph (run it eagerly)."""
        n = input_ids.shape[0]
        if meta.seq_lens.shape[0] != n or meta.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        key = self.lookup(
            n, meta.max_query_len, meta.max_seq_len, self._kv_caches if kv_caches is None else kv_caches
        )
        if key is None:
            return None
        size = key[0]
        inp = self.inputs
        inp.input_ids[:n].copy_(input_ids, non_blocking=True)
        inp.positions[:n].copy_(positions, non_blocking=True)
        inp.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        inp.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        inp.query_start_loc[: size + 1].copy_(self._qsl[: size + 1])
        # Columns past `width` keep older rows' blocks: never read, seq_lens bounds every read.
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if n < size:
            inp.input_ids[n:size].zero_()
            inp.positions[n:size].zero_()
            inp.slot_mapping[n:size].fill_(-1)
            inp.seq_lens[n:size].zero_()
        return self.replay(key)[:n]
