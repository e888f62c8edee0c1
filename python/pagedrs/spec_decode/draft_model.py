"""Speculative decoding with a draft model: a second, smaller model that shares the target's tokenizer
proposes the drafts (vLLM's `{"method": "draft_model", "model": ...}`).

The draft keeps its own KV pool, with the target's block ids: the same number of blocks (and swap
blocks), indexed by the target's block tables and slot mappings, and given the same block ops (copies,
swaps, moves) each step, so prefix-cache hits, forks and preemption hold for it too. In a step where
some sequence speculates, before the target's forward, the draft runs once over the step's tokens
(prompt chunks, decode tokens, the draft placeholders), which writes its KV wherever the target writes
its own; its logits at a speculating sequence's last token are the first draft. Then decode-shaped
sub-steps feed draft `j` at position `nc + j`, for `j` = 1 .. d: each overwrites the placeholder's KV
with the draft token and gives draft `j + 1`; the last one only writes the KV, so that when every draft
is accepted the draft's cache still covers every position before the next step's last token. Whatever
the drafts, the target verifies them exactly: a draft KV that is off only lowers the acceptance rate.

Drafts are the draft's argmax for a sequence that decodes greedily. For one that samples (temperature
> 0) each draft is sampled from the draft's distribution under the sequence's own temperature, top-k,
top-p and min-p (from its generator when seeded), and that distribution goes to the verifier as q, so
acceptance is min(1, p/q) (vLLM's and the papers' speculative sampling): a draft close to the target is
accepted about as often as it would be greedy on greedy requests.

Lazy KV (what llama.cpp's server gets by keeping the draft's context per slot): a step where no
sequence speculates (speculation paused by the batch-size cut-off or the engine's governor, or a
sequence's own pause) costs the draft nothing. Its decode tokens are kept, per sequence, in a backlog;
the next step in which that sequence's draft KV is written (it speculates, or a prompt chunk of it
runs) feeds the backlog first, as one prefill-shaped forward, so the draft's cache is complete again
when it proposes. Prompt chunks always run through the draft at once, so blocks that prefix caching
shares carry the draft's KV too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from pagedrs.config import kv_cache_torch_dtype
from pagedrs.layers.attention import ForwardContext
from pagedrs.layers.sampler import GREEDY_EPS
from pagedrs.spec_decode.interface import DrafterContext, KVPool, Proposal, StepContext
from pagedrs.spec_decode.rejection_sampler import sampling_probs
from pagedrs.spec_decode.substep import speculating_rows, substep_forward, varlen_forward

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagedrs._core import StepPlan
    from pagedrs.layers.sampler import SamplingRow

__all__ = ["DraftModelDrafter"]

# A backlog not extended or fed for this many steps belongs to a sequence that finished (or waits
# swapped out for that long): it is dropped, and a sequence that does come back proposes from a draft
# cache with a hole (a lower acceptance rate, never a wrong token).
_BACKLOG_IDLE_STEPS = 4096


class _Backlog:
    """The tokens of one sequence that ran while its draft KV was not written: positions `start ..`."""

    __slots__ = ("chunks", "last_step", "start")

    def __init__(self, start: int, step: int) -> None:
        self.start = start
        self.chunks: list[np.ndarray] = []
        self.last_step = step

    @property
    def end(self) -> int:
        return self.start + sum(len(c) for c in self.chunks)

    def tokens(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.int64)


class _Picker:
    """Chooses drafts from the draft's logits: the argmax for a greedy sequence; for a sampling one a
    sample of `sampling_probs` under its parameters (its generator when seeded, else `default`), whose
    distribution is kept as the draft's q row (`probs`, in the flattened draft layout)."""

    def __init__(
        self,
        rows: Sequence[SamplingRow] | None,
        spec: np.ndarray,
        counts: np.ndarray,
        default: torch.Generator | None,
    ) -> None:
        n = len(spec)
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.generators: list[torch.Generator | None] = [None] * n
        if rows is not None:
            for i, s in enumerate(spec.tolist()):
                row = rows[s]
                p = row.params
                self.temperature[i], self.top_k[i] = p.temperature, p.top_k
                self.top_p[i], self.min_p[i] = p.top_p, p.min_p
                self.generators[i] = row.generator
        self.random = self.temperature >= GREEDY_EPS
        self.starts = np.cumsum(counts) - counts  # each sequence's first draft in the flattened layout
        self.total = int(counts.sum())
        self.default = default
        self.probs: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, which: np.ndarray, j: int) -> torch.Tensor:
        """Draft `j` (0-based) of the speculating sequences `which` (indices into `spec`), whose logits
        rows these are, in that order."""
        tok = logits.argmax(dim=-1)
        r = np.flatnonzero(self.random[which])
        if not len(r):
            return tok
        seqs = which[r]
        probs = sampling_probs(
            logits[torch.as_tensor(r, device=logits.device)],
            self.temperature[seqs],
            self.top_k[seqs],
            self.top_p[seqs],
            self.min_p[seqs],
        )
        race = torch.empty_like(probs)
        for i, s in enumerate(seqs.tolist()):
            gen = self.generators[s]
            race[i].exponential_(generator=gen if gen is not None else self.default)
        tok[torch.as_tensor(r, device=tok.device)] = probs.div(race).argmax(dim=-1)
        if self.probs is None:
            self.probs = torch.zeros(self.total, probs.shape[1], device=probs.device)
        self.probs[torch.as_tensor(self.starts[seqs] + j, device=probs.device)] = probs
        return tok


class DraftModelDrafter:
    """Proposes drafts with `context.draft_model`, a separate model over the target's vocabulary."""

    scheduler_method: ClassVar[str] = "runner"
    # Not measured (no smaller model shares the default model's tokenizer here): batch 1 only.
    default_disable_by_batch_size: ClassVar[int] = 1

    def __init__(self, context: DrafterContext) -> None:
        model = context.draft_model
        if model is None:
            raise ValueError("speculative_config method 'draft_model' needs the loaded draft model")
        target_vocab = int(context.target.config.vocab_size)
        draft_vocab = int(model.config.vocab_size)
        if draft_vocab > target_vocab:
            raise ValueError(
                f"speculative_config model has a vocabulary of {draft_vocab} tokens, more than the target's "
                f"{target_vocab}: the draft model must share the target's tokenizer"
            )
        self.context = context
        self.model = model
        self.kv_dtype = kv_cache_torch_dtype(context.config.cache.cache_dtype, model.dtype)
        self.pool: KVPool | None = None
        self.buffers = context.new_substep_buffers()
        self.backlogs: dict[int, _Backlog] = {}  # seq id -> tokens whose draft KV is not written
        self.num_skipped_steps = 0  # steps with tokens in which the draft did not run
        self.num_catch_up_tokens = 0  # backlog tokens fed later

    @property
    def kv_bytes_per_block(self) -> int:
        """Its own pool's bytes per block (the pool has as many blocks as the target's)."""
        return self.context.kv_block_bytes(self.model, self.kv_dtype)

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        self.pool = self.context.new_kv_pool(self.model, num_blocks, num_swap_blocks, self.kv_dtype)

    def apply_plan_ops(self, plan: StepPlan) -> None:
        if self.pool is not None:
            self.pool.apply_plan_ops(plan)

    def apply_plan_shrink(self, plan: StepPlan) -> None:
        if self.pool is not None:
            self.pool.apply_plan_shrink(plan)

    def runs(self, plan: StepPlan) -> bool:
        return True  # sees every step: writes its KV or keeps the step's tokens for later

    @torch.inference_mode()
    def propose(self, step: StepContext) -> Proposal:
        """Writes the draft's KV for the step (or keeps its tokens in backlogs: see the module doc; the
        step's attention metadata, which the target's forward then reuses, serves a forward over the
        whole step), then proposes: the drafts of every speculating sequence, flattened in sampled order
        (the layout of `plan.draft_token_ids`), also written into `step.inputs.input_ids` at their
        positions, with the distributions of the sampled ones."""
        plan, main, pool = step.plan, step.inputs, self.pool
        assert pool is not None, "init_kv_cache() first"
        nd = np.asarray(plan.num_draft_tokens)
        spec = np.nonzero(nd)[0]
        rows, first = speculating_rows(plan, spec)
        hidden_first = self._fill(step, rows, first)
        if not len(spec):
            return Proposal(np.zeros(0, dtype=np.int64))
        assert hidden_first is not None
        counts = nd[spec].astype(np.int64)
        drafts = np.zeros((len(spec), int(counts.max())), dtype=np.int64)
        device = main.input_ids.device
        pick = _Picker(step.rows, spec, counts, self.context.generator)
        every = np.arange(len(spec))
        logits = self.model.compute_logits(hidden_first)
        assert logits is not None, "a draft model runs whole on rank 0"
        nxt = pick(logits, every, 0)
        main.input_ids.index_copy_(0, torch.as_tensor(first + 1, device=device), nxt)
        drafts[:, 0] = nxt.cpu().numpy()
        for j in range(1, drafts.shape[1] + 1):
            act = np.nonzero(counts >= j)[0]  # draft j exists: feed it at position nc + j
            tok = first[act] + j
            hidden = substep_forward(
                self.context,
                step,
                self.buffers,
                rows[act],
                tok,
                drafts[act, j - 1],
                kv_caches=pool.kv_caches,
                model=self.model,
            )
            more = np.nonzero(counts[act] > j)[0]  # those that want draft j + 1
            if not len(more):
                continue
            logits = self.model.compute_logits(hidden[torch.as_tensor(more, device=hidden.device)])
            assert logits is not None
            nxt = pick(logits, act[more], j)
            main.input_ids.index_copy_(0, torch.as_tensor(tok[more] + 1, device=device), nxt)
            drafts[act[more], j] = nxt.cpu().numpy()
        return Proposal(np.concatenate([drafts[i, : counts[i]] for i in range(len(spec))]), pick.probs)

    def _fill(self, step: StepContext, spec_rows: np.ndarray, first: np.ndarray) -> torch.Tensor | None:
        """The draft's forward over the step's rows that speculate or run prompt tokens, each after its
        backlog; the other rows' tokens join their backlogs. The final hidden states at the speculating
        rows' last tokens (`first`, in the step's layout), or None when none speculates."""
        assert self.pool is not None
        plan, main = step.plan, step.inputs
        step_id = int(plan.step_id)
        qsl = plan.query_start_loc
        seq_ids = plan.req_ids
        fill = plan.num_computed_tokens < plan.num_prompt_tokens
        fill[spec_rows] = True
        fed: dict[int, np.ndarray] = {}  # batch row -> its backlog's tokens, fed before the row's own
        for b in range(len(seq_ids)):
            sid, start = int(seq_ids[b]), int(plan.positions[qsl[b]])
            log = self.backlogs.get(sid)
            if log is not None and log.end != start:  # recomputed from an earlier position: stale
                log = None
                del self.backlogs[sid]
            if fill[b]:
                if log is not None:
                    fed[b] = log.tokens()
                    del self.backlogs[sid]
                continue
            if log is None:
                log = self.backlogs[sid] = _Backlog(start, step_id)
            log.chunks.append(plan.input_ids[qsl[b] : qsl[b + 1]].astype(np.int64))
            log.last_step = step_id
        if step_id % 256 == 0:
            stale = [s for s, log in self.backlogs.items() if step_id - log.last_step > _BACKLOG_IDLE_STEPS]
            for s in stale:
                del self.backlogs[s]
        if not fill.any():
            self.num_skipped_steps += 1
            return None
        kv = self.pool.kv_caches
        if fill.all() and not fed:  # the step as the target runs it: share its metadata
            # without the target's KV-cache groups: the draft's own pool holds every block of every layer
            meta = replace(step.attn_metadata, groups={}) if step.attn_metadata.groups else step.attn_metadata
            ctx = ForwardContext(attn_metadata=meta, kv_caches=kv, backend=self.context.backend)
            hidden = self.model(main.input_ids, main.positions, ctx)
            return hidden[torch.as_tensor(first, device=hidden.device)] if len(first) else None
        rows = np.nonzero(fill)[0]
        ids, pos, slots, lens = [], [], [], np.zeros(len(rows), dtype=np.int64)
        at = np.zeros(len(rows), dtype=np.int64)  # where each row's own tokens start in the flattened fill
        total = 0
        for i, b in enumerate(rows.tolist()):
            own = slice(int(qsl[b]), int(qsl[b + 1]))
            back = fed.get(b)
            if back is not None and len(back):
                start = int(plan.positions[own.start]) - len(back)
                p = np.arange(start, start + len(back), dtype=np.int64)
                table = self._table_row(step, b)
                bs = self.context.block_size
                ids.append(back)
                pos.append(p)
                slots.append(table[p // bs].astype(np.int64) * bs + p % bs)
                self.num_catch_up_tokens += len(back)
            ids.append(plan.input_ids[own].astype(np.int64))
            pos.append(plan.positions[own].astype(np.int64))
            slots.append(plan.slot_mapping[own].astype(np.int64))
            at[i] = total + (0 if back is None else len(back))
            lens[i] = at[i] - total + own.stop - own.start
            total += int(lens[i])
        hidden = varlen_forward(
            self.context,
            step,
            self.buffers,
            rows,
            np.concatenate(ids),
            np.concatenate(pos),
            np.concatenate(slots),
            lens,
            kv_caches=kv,
            model=self.model,
        )
        if not len(first):
            return None
        where = {b: int(at[i]) for i, b in enumerate(rows.tolist())}
        idx = [where[int(b)] for b in spec_rows.tolist()]  # a speculating row's last token: its first own
        return hidden[torch.as_tensor(idx, device=hidden.device)]

    def _table_row(self, step: StepContext, b: int) -> np.ndarray:
        """Batch row `b`'s block table (host): the scheduler's persistent view, or the plan's dense one."""
        plan, view = step.plan, step.block_table_view
        if view is not None:
            return np.asarray(view[int(plan.block_table_rows[b])])
        return np.asarray(plan.block_tables[b])
