"""The engine core's image side of adding a request: the runner takes the request's items, the scheduler
takes the prompt with hash-derived ids at the placeholders (the prefix-cache key) and, for a model whose
image tokens attend both ways, each item as a span a prefill chunk takes whole; with an encoder budget
(`max_num_encoder_input_tokens`, as vLLM's scheduler) each item as a span charged to the step whose chunk
reaches it first, an item larger than the whole budget refused. An item is charged once per image hash, as
vLLM's encoder cache manager: before each step the scheduler learns which outputs the runner's encoder cache
holds (`sync`), and a held one, or one the step already charged, costs nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedrs.multimodal import MultiModalItem, atomic_spans, scheduler_token_ids
from pagedrs.multimodal.mrope import mrope_table

__all__ = ["ImageAdmission", "check_encoder_budget"]


def check_encoder_budget(lengths: list[int], budget: int | None) -> None:
    """ValueError for an image whose encoder rows exceed the whole per-step budget (it could never be
    scheduled), naming the value."""
    for n in lengths:
        if budget is not None and n > budget:
            raise ValueError(
                f"an image of {n} encoder tokens does not fit max_num_encoder_input_tokens={budget}: "
                "raise it or send a smaller image"
            )


class ImageAdmission:
    def __init__(
        self,
        executor: Any,
        scheduler: Any,
        vocab_size: int,
        *,
        atomic: bool,
        encoder_budget: int | None = None,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.atomic = atomic  # the model's image tokens attend both ways (`CausalLM.mm_bidirectional`)
        self.encoder_budget = encoder_budget  # encoder rows a step may reach; None: no budget
        if encoder_budget is not None:
            scheduler.set_encoder_budget(encoder_budget)

    def admit(
        self,
        seq_ids: Sequence[int],
        prompt: Sequence[int],
        items: list[MultiModalItem],
        mrope: tuple[list[int], int] | None = None,
    ) -> list[int]:
        """Register the items and the M-RoPE table `(flat [3, L] positions, delta)` if any (ValueError
        where the model takes no images, or for an item larger than the encoder budget); the ids the
        scheduler gets."""
        budget = self.encoder_budget
        check_encoder_budget([it.length for it in items], budget)
        table = mrope_table(*mrope) if mrope is not None else None
        self.executor.add_mm_request(seq_ids, items, table)
        if self.atomic:
            for sid in seq_ids:
                self.scheduler.set_atomic_spans(sid, atomic_spans(items))
        if budget is not None:
            spans = [(it.offset, it.offset + it.length, it.hash) for it in items]
            for sid in seq_ids:
                self.scheduler.set_encoder_spans(sid, spans)
        return scheduler_token_ids(prompt, items, self.vocab_size)

    def sync(self) -> None:
        """Before a step: the runner's encoder-cache changes into the scheduler's budget (with a budget)."""
        if self.encoder_budget is not None:
            added, removed = self.executor.encoder_cache_changes()
            if added or removed:
                self.scheduler.update_encoder_cache(added, removed)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.executor.drop_mm_request(seq_ids)
