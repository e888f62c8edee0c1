"""The model runner's image side of a step (a mixin of `ModelRunner`): the encoder rows of the step's
scheduled image tokens (`multimodal.encoder_cache`), the bidirectional key limits of a model whose image
tokens see their whole image, and the forward with both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pagedrs._core import StepPlan
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import ForwardContext
from pagedrs.multimodal import MultiModalItem
from pagedrs.multimodal.encoder_cache import EncoderCache, MultiModalStep
from pagedrs.multimodal.mrope import MRopeTable, step_mrope_positions
from pagedrs.runner.mm_share import share_mm_step, share_positions

if TYPE_CHECKING:
    from pagedrs.models.interface import CausalLM
    from pagedrs.runner.step_buffers import StepInputs

__all__ = ["MultiModalStepMixin"]


class MultiModalStepMixin:
    model: CausalLM
    device: torch.device
    encoder_cache: EncoderCache | None
    tp: TPGroup

    def add_mm_request(
        self, seq_ids: Sequence[int], items: list[MultiModalItem], mrope: MRopeTable | None = None
    ) -> None:
        """The sequences `seq_ids` (a request's samples) carry `items` (and an M-RoPE model's position
        table) until `drop_mm_request`."""
        if self.encoder_cache is None:
            raise ValueError(f"{type(self.model).__name__} takes no images")
        self.encoder_cache.add(seq_ids, items, mrope)

    def step_positions(self, plan: StepPlan, positions: Tensor) -> Tensor:
        """The positions the model takes: [3, T] for an M-RoPE model (`multimodal.mrope`), else as given."""
        if not self.model.uses_mrope:
            return positions
        tables = self.encoder_cache.mrope if self.encoder_cache is not None else {}
        rows = step_mrope_positions(plan.positions, plan.query_start_loc, plan.req_ids, tables)
        out = torch.from_numpy(rows).to(positions.device)
        return share_positions(self.tp, out) if self.tp.size > 1 else out  # rank 0 holds the tables

    def drop_mm_request(self, seq_ids: Sequence[int]) -> None:
        if self.encoder_cache is not None:
            self.encoder_cache.drop(seq_ids)

    def encoder_cache_changes(self) -> tuple[list[str], list[str]]:
        """Image hashes whose encoder outputs were stored, and those evicted, since the last call."""
        return self.encoder_cache.take_changes() if self.encoder_cache is not None else ([], [])

    def _mm_step(self, plan: StepPlan) -> MultiModalStep | None:
        """This step's image rows: run here on rank 0 (it holds the requests' images), broadcast to the
        other tensor-parallel ranks (`runner.mm_share`)."""
        mm = self._run_mm_step(plan) if self.tp.is_driver else None
        if self.tp.size > 1:
            mm = share_mm_step(self.tp, mm, int(plan.num_tokens), self.device)
        return mm

    def _run_mm_step(self, plan: StepPlan) -> MultiModalStep | None:
        cache = self.encoder_cache
        assert cache is not None
        return cache.step(
            plan.req_ids,
            plan.num_computed_tokens,
            plan.num_scheduled_tokens,
            plan.query_start_loc,
            plan.positions,
            self.model.embed_multimodal,
            self.device,
            bidirectional=self.model.mm_bidirectional,
        )

    def _forward_mm(
        self, inputs: StepInputs, positions: Tensor, ctx: ForwardContext, mm: MultiModalStep
    ) -> Tensor:
        """The forward of a step with image rows; a bidirectional model's attention metadata (and its
        window groups') takes the step's key limits."""
        meta = ctx.attn_metadata
        if mm.key_limits is not None and meta is not None:
            if getattr(ctx.backend, "name", "torch") != "torch":
                raise NotImplementedError(
                    f"{type(self.model).__name__}: bidirectional image attention runs on the torch "
                    "attention backend only (attention_backend='torch')"
                )
            for m in (meta, *meta.groups.values()):
                m.key_limits = mm.key_limits
                m.key_limit_reqs = mm.key_limit_reqs
        return self.model(inputs.input_ids, positions, ctx, mm=mm.batch)
