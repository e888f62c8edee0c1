"""Speculative decoding with a draft model: a second, smaller model that shares the target's tokenizer
proposes the drafts (vLLM's `{"method": "draft_model", "model": ...}`).

The draft keeps its own KV pool, with the target's block ids: the same number of blocks (and swap
blocks), indexed by the target's block tables and slot mappings, and given the same block ops (copies,
swaps, moves) each step, so prefix-cache hits, forks and preemption hold for it too. Every step with
tokens, before the target's forward, the draft runs once over the whole step (prompt chunks, decode
tokens, the draft placeholders), which writes its KV wherever the target writes its own; its logits at a
speculating sequence's last token are the first draft. Then decode-shaped sub-steps feed draft `j` at
position `nc + j`, for `j` = 1 .. d: each overwrites the placeholder's KV with the draft token and gives
draft `j + 1`; the last one only writes the KV, so that when every draft is accepted the draft's cache
still covers every position before the next step's last token. Whatever the drafts, the target
verifies them exactly: a draft KV that is off only lowers the acceptance rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedrs.config import kv_cache_torch_dtype
from pagedrs.layers.attention import AttentionMetadata, ForwardContext
from pagedrs.worker.kv_cache import KVCachePool, model_block_bytes
from pagedrs.worker.self_draft import speculating_rows, substep_buffers, substep_forward
from pagedrs.worker.step_buffers import StepInputs

if TYPE_CHECKING:
    from pagedrs._core import StepPlan
    from pagedrs.worker.model_runner import ModelRunner

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter:
    """Proposes drafts with `model`, a separate model over the target's vocabulary."""

    every_step = True  # its KV must see every token the target's does

    def __init__(self, runner: ModelRunner, model: Any) -> None:
        target_vocab = int(runner.model.config.vocab_size)
        draft_vocab = int(model.config.vocab_size)
        if draft_vocab > target_vocab:
            raise ValueError(
                f"speculative_config model has a vocabulary of {draft_vocab} tokens, more than the target's "
                f"{target_vocab}: the draft model must share the target's tokenizer"
            )
        self.runner = runner
        self.model = model
        self.kv_dtype = kv_cache_torch_dtype(runner.config.cache.cache_dtype, model.dtype)
        self.pool: KVCachePool | None = None
        self.buffers = substep_buffers(runner)

    @property
    def bytes_per_block(self) -> int:
        return model_block_bytes(self.model, self.runner.block_size, self.kv_dtype)

    def init_pool(self, num_blocks: int, num_swap_blocks: int) -> KVCachePool:
        self.pool = KVCachePool.for_model(
            self.model,
            block_size=self.runner.block_size,
            num_blocks=num_blocks,
            dtype=self.kv_dtype,
            device=self.runner.device,
            num_swap_blocks=num_swap_blocks,
        )
        return self.pool

    @torch.inference_mode()
    def propose(self, plan: StepPlan, main: StepInputs, meta: AttentionMetadata) -> np.ndarray:
        """Runs the draft over the step (its KV; `meta`: the step's attention metadata, which the target's
        forward then reuses), then proposes: the drafts of every speculating sequence, flattened in sampled
        order (the layout of `plan.draft_token_ids`), also written into `main.input_ids` at their
        positions."""
        runner, pool = self.runner, self.pool
        assert pool is not None, "init_pool() first"
        ctx = ForwardContext(attn_metadata=meta, kv_caches=pool.kv_caches, backend=runner.backend)
        hidden = self.model(main.input_ids, main.positions, ctx)
        nd = np.asarray(plan.num_draft_tokens)
        spec = np.nonzero(nd)[0]
        if not len(spec):
            return np.zeros(0, dtype=np.int64)
        rows, first = speculating_rows(plan, spec)
        counts = nd[spec].astype(np.int64)
        drafts = np.zeros((len(spec), int(counts.max())), dtype=np.int64)
        device = main.input_ids.device
        nxt = self.model.compute_logits(hidden[torch.as_tensor(first, device=hidden.device)]).argmax(dim=-1)
        main.input_ids.index_copy_(0, torch.as_tensor(first + 1, device=device), nxt)
        drafts[:, 0] = nxt.cpu().numpy()
        for j in range(1, drafts.shape[1] + 1):
            act = np.nonzero(counts >= j)[0]  # draft j exists: feed it at position nc + j
            tok = first[act] + j
            hidden = substep_forward(
                runner,
                self.buffers,
                plan,
                rows[act],
                tok,
                drafts[act, j - 1],
                kv_caches=pool.kv_caches,
                model=self.model,
            )
            more = np.nonzero(counts[act] > j)[0]  # those that want draft j + 1
            if not len(more):
                continue
            nxt = self.model.compute_logits(hidden[torch.as_tensor(more, device=hidden.device)]).argmax(
                dim=-1
            )
            main.input_ids.index_copy_(0, torch.as_tensor(tok[more] + 1, device=device), nxt)
            drafts[act[more], j] = nxt.cpu().numpy()
        return np.concatenate([drafts[i, : counts[i]] for i in range(len(spec))])
