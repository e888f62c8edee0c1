"""The engine core's image side of adding a request: the runner takes the request's items, the scheduler
takes the prompt with hash-derived ids at the placeholders (the prefix-cache key) and, for a model whose
image tokens attend both ways, each item as a span a prefill chunk takes whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedrs.multimodal import MultiModalItem, atomic_spans, scheduler_token_ids
from pagedrs.multimodal.mrope import mrope_table

__all__ = ["ImageAdmission"]


class ImageAdmission:
    def __init__(self, executor: Any, scheduler: Any, vocab_size: int, *, atomic: bool) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.atomic = atomic  # the model's image tokens attend both ways (`CausalLM.mm_bidirectional`)

    def admit(
        self,
        seq_ids: Sequence[int],
        prompt: Sequence[int],
        items: list[MultiModalItem],
        mrope: tuple[list[int], int] | None = None,
    ) -> list[int]:
        """Register the items and the M-RoPE table `(flat [3, L] positions, delta)` if any (ValueError
        where the model takes no images); the ids the scheduler gets."""
        table = mrope_table(*mrope) if mrope is not None else None
        self.executor.add_mm_request(seq_ids, items, table)
        if self.atomic:
            for sid in seq_ids:
                self.scheduler.set_atomic_spans(sid, atomic_spans(items))
        return scheduler_token_ids(prompt, items, self.vocab_size)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.executor.drop_mm_request(seq_ids)
