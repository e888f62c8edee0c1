"""A minimal stand-in for the model runner: hands out blocks, builds AttentionMetadata for a step in
which each request contributes some new tokens, and returns the logits of every token."""

from __future__ import annotations

import random

import torch

from pagedrs.layers.attention import AttentionMetadata, ForwardContext
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend


class PagedHarness:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        self.model = model
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        shapes = getattr(model, "kv_cache_shapes", None) or [(model.num_kv_heads, model.head_size)] * int(
            model.num_layers
        )
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, h, d, dtype=dtype) for h, d in shapes]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        self.backend = TorchAttentionBackend()

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """chunks: req_id -> the next token ids of that request. Returns req_id -> logits [n, vocab]."""
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for rid, toks in chunks.items():
            table = self.tables.setdefault(rid, [])
            start = self.num_computed.get(rid, 0)
            end = start + len(toks)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids.extend(toks)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(list(table))
            self.num_computed[rid] = end
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
            num_decode_tokens=sum(1 for t in chunks.values() if len(t) == 1),
        )
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches, backend=self.backend)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
            logits = self.model.compute_logits(hidden)
        return {rid: logits[qsl[i] : qsl[i + 1]] for i, rid in enumerate(chunks)}


# Chunked prefill over two steps, a prefix-only request, then decodes: request id -> the step's new tokens.
MIXED_STEPS: list[dict[int, list[int]]] = [
    {0: list(range(10, 23)), 1: [5, 6, 7]},
    {0: list(range(40, 46)), 1: [8], 2: [1, 2, 3, 4, 5, 6, 7, 8, 9]},
    {0: [3], 1: [9], 2: [10]},
    {0: [4], 1: [11], 2: [12]},
]


def run_mixed_steps(model: torch.nn.Module, backend: object) -> list[dict[int, torch.Tensor]]:
    """MIXED_STEPS through a fresh harness (32 blocks of 4) with `backend`: each step's logits."""
    harness = PagedHarness(model, num_blocks=32, block_size=4, seed=1)
    harness.backend = backend  # type: ignore[assignment]
    return [harness.step(chunks) for chunks in MIXED_STEPS]


def assert_steps_close(
    ref: list[dict[int, torch.Tensor]], ours: list[dict[int, torch.Tensor]], *, same_argmax: bool = False
) -> None:
    """Every step's logits of every request within 1e-4 (and, if asked, the same greedy token)."""
    for step, (r, o) in enumerate(zip(ref, ours, strict=True)):
        for rid in r:
            torch.testing.assert_close(
                o[rid],
                r[rid],
                atol=1e-4,
                rtol=1e-4,
                msg=lambda m, s=step, q=rid: f"step {s} request {q}: {m}",
            )
            if same_argmax:
                assert torch.equal(o[rid].argmax(-1), r[rid].argmax(-1)), f"step {step} request {rid}"
