"""A small pure-Python stand-in for `pagedrs._core.Scheduler` (same plan fields), used to test the model
runner and the engine loop on their own: chunked prefill under a token budget, n > 1 forks (prompt blocks
copied through plan.copies), recompute preemption when the pool runs dry. No prefix caching, no swap."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]
    num_prompt: int
    max_tokens: int
    min_tokens: int
    stops: set[int]
    stop_ids: set[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    children: list[int] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


class FakeScheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        **_: object,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.budget, self.max_num_seqs, self.max_model_len = (
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
        )
        self.free = list(range(num_blocks))
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.pending_children: dict[int, list[_Seq]] = {}
        self.num_preemptions = 0
        self.deferred_copies: list[tuple[int, int]] = []  # fork copies run before the children's first step

    def add_request(
        self,
        seq_ids,
        prompt_token_ids,
        *,
        max_tokens,
        min_tokens=0,
        eos_token_ids=(),
        stop_token_ids=(),
        ignore_eos=False,
        **_: object,
    ) -> None:
        prompt = [int(t) for t in prompt_token_ids]
        if len(prompt) + 1 > self.max_model_len:
            raise ValueError(f"prompt {len(prompt)} + 1 > max_model_len {self.max_model_len}")
        max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        stops = set() if ignore_eos else set(eos_token_ids)
        seqs = [
            _Seq(s, list(prompt), len(prompt), max_tokens, min_tokens, stops, set(stop_token_ids))
            for s in seq_ids
        ]
        self.waiting.append(seqs[0])
        self.pending_children[seqs[0].seq_id] = seqs[1:]

    def _alloc(self, seq: _Seq, upto: int) -> bool:
        need = -(-upto // self.block_size) - len(seq.blocks)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.blocks.append(self.free.pop(0))
        return True

    def _free(self, seq: _Seq) -> None:
        self.free.extend(reversed(seq.blocks))
        seq.blocks = []

    def schedule(self):
        budget = self.budget
        sched: list[tuple[_Seq, int]] = []
        copies, self.deferred_copies = self.deferred_copies, []
        preempted: list[int] = []
        queue = self.running + self.waiting
        for seq in queue:
            if budget == 0 or len(sched) >= self.max_num_seqs:
                break
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._alloc(seq, seq.num_computed + n):
                victim = next(
                    (s for s in reversed(self.running) if s is not seq and all(s is not x for x, _ in sched)),
                    None,
                )
                if victim is None:
                    n = 0
                    break
                self._free(victim)
                victim.num_computed = 0
                self.running.remove(victim)
                self.waiting.insert(0, victim)
                preempted.append(victim.seq_id)
                self.num_preemptions += 1
            if n == 0:
                break
            if seq in self.waiting:
                self.waiting.remove(seq)
                self.running.append(seq)
            sched.append((seq, n))
            budget -= n
        ids, pos, slots, qsl, logits_idx, sampled = [], [], [], [0], [], []
        for seq, n in sched:
            start = seq.num_computed
            for p in range(start, start + n):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // self.block_size] * self.block_size + p % self.block_size)
            qsl.append(qsl[-1] + n)
            if start + n == len(seq.tokens):
                logits_idx.append(qsl[-1] - 1)
                sampled.append(seq.seq_id)
                for child in self.pending_children.pop(seq.seq_id, []):
                    self._alloc(child, start + n)
                    self.deferred_copies += list(zip(seq.blocks, child.blocks, strict=False))
                    child.num_computed = start + n
                    self.running.append(child)
                    logits_idx.append(qsl[-1] - 1)
                    sampled.append(child.seq_id)
        width = max([len(s.blocks) for s, _ in sched] or [1])
        tables = np.zeros((len(sched), width), dtype=np.int32)
        for i, (s, _) in enumerate(sched):
            tables[i, : len(s.blocks)] = s.blocks
        num_sched = np.array([n for _, n in sched], dtype=np.int32)
        computed = np.array([s.num_computed for s, _ in sched], dtype=np.int32)
        plan = SimpleNamespace(
            req_ids=np.array([s.seq_id for s, _ in sched], dtype=np.int64),
            num_scheduled_tokens=num_sched,
            num_computed_tokens=computed,
            num_prompt_tokens=np.array([s.num_prompt for s, _ in sched], dtype=np.int32),
            seq_lens=(computed + num_sched).astype(np.int32),
            query_start_loc=np.array(qsl, dtype=np.int32),
            input_ids=np.array(ids, dtype=np.int64),
            positions=np.array(pos, dtype=np.int64),
            slot_mapping=np.array(slots, dtype=np.int64),
            block_tables=tables,
            logits_indices=np.array(logits_idx, dtype=np.int64),
            sampled_seq_ids=np.array(sampled, dtype=np.int64),
            swap_out=np.zeros((0, 2), np.int64),
            swap_in=np.zeros((0, 2), np.int64),
            copies=np.array(copies, dtype=np.int64).reshape(-1, 2),
            block_moves=np.zeros((0, 2), np.int64),
            preempted=np.array(preempted, dtype=np.int64),
            num_blocks=self.num_blocks,
            num_prefill_tokens=int(sum(n for s, n in sched if n > 1 or s.num_computed < s.num_prompt)),
            num_decode_tokens=int(sum(1 for s, n in sched if n == 1 and s.num_computed >= s.num_prompt)),
            num_tokens=len(ids),
            _sched=sched,
        )
        for seq, n in sched:
            seq.num_computed += n
        return plan

    def update(self, plan, sampled_token_ids):
        by_id = {s.seq_id: s for s in self.running}
        finished = []
        for sid, tok in zip(
            plan.sampled_seq_ids.tolist(), np.asarray(sampled_token_ids).tolist(), strict=True
        ):
            seq = by_id[sid]
            seq.tokens.append(int(tok))
            reason, stop_tok = None, None
            if seq.num_output >= seq.min_tokens:
                if tok in seq.stops:
                    reason = "stop"
                elif tok in seq.stop_ids:
                    reason, stop_tok = "stop", int(tok)
            if reason is None and (seq.num_output >= seq.max_tokens or len(seq.tokens) >= self.max_model_len):
                reason = "length"
            if reason is not None:
                finished.append((sid, reason, stop_tok))
                self._free(seq)
                self.running.remove(seq)
        return finished

    def abort(self, seq_ids) -> None:
        ids = set(seq_ids)
        for lst in (self.running, self.waiting):
            for s in [s for s in lst if s.seq_id in ids]:
                self._free(s)
                lst.remove(s)
        for k in [k for k in self.pending_children if k in ids]:
            del self.pending_children[k]

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def num_cached_tokens(self, seq_id: int) -> int:
        return 0

    def stats(self) -> dict:
        return dict(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=0,
            num_blocks=self.num_blocks,
            num_free_blocks=len(self.free),
            kv_usage=1 - len(self.free) / self.num_blocks,
            num_swap_blocks=0,
            num_free_swap_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=self.num_preemptions,
        )
