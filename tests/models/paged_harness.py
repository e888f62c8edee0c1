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
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, model.num_kv_heads, model.head_size, dtype=dtype)
            for _ in range(model.num_layers)
        ]
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
