"""A tiny model runner for the core tests: executes plans on a simulated KV memory and checks them.

Each slot holds a hash of the token prefix that produced it; after every forward each row's whole
context is read back through its block table and compared with what its own tokens say. Like a real
runner, the sim keeps its own copy of the persistent block table, updated from plan.changed_rows
only, and reads the batch's blocks through it (plan.block_tables must agree).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from pagedrs._core import FinishReason, Scheduler, StepPlan


def _h(prev: int, token: int, pos: int) -> int:
    return hash((prev, token, pos)) | 1


@dataclass
class Mirror:
    tokens: list[int]
    prompt_len: int
    max_tokens: int


@dataclass
class Sim:
    sched: Scheduler
    block_size: int
    num_swap_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    vocab: int = 8
    live: dict[int, Mirror] = field(default_factory=dict)
    mem: dict[int, int] = field(default_factory=dict)
    swap_mem: dict[int, int] = field(default_factory=dict)
    next_id: int = 1
    seen: dict[str, int] = field(default_factory=lambda: dict(preempted=0, swap_out=0, copies=0, moves=0))
    table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))

    @classmethod
    def make(cls, seed: int = 0, **kw: object) -> Sim:
        s = Scheduler(**kw)  # type: ignore[arg-type]
        sim = cls(
            s,
            s.block_size,
            int(kw.get("num_swap_blocks", 0)),
            int(kw.get("max_num_batched_tokens", 2048)),
            int(kw.get("max_num_seqs", 256)),
            random.Random(seed),
        )
        sim.table = s.block_table_view().copy()
        return sim

    def check_table(self) -> None:
        """The sim's copy, updated from changed_rows only, equals the scheduler's table."""
        assert np.array_equal(self.table, self.sched.block_table_view())

    def add(self, prompt: list[int], n: int = 1, max_tokens: int = 8, **kw: object) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.sched.add_request(ids, prompt, max_tokens=max_tokens, eos_token_ids=[0], **kw)  # type: ignore[arg-type]
        self.next_id += n
        for i in ids:
            self.live[i] = Mirror(list(prompt), len(prompt), max_tokens)
        return ids

    def abort(self, ids: list[int]) -> None:
        self.sched.abort(ids)
        for i in ids:
            self.live.pop(i, None)

    def schedule_and_run(self) -> StepPlan:
        p = self.sched.schedule()
        self.execute(p)
        return p

    def update(
        self, p: StepPlan, sampled: np.ndarray | None = None
    ) -> list[tuple[int, FinishReason, int | None]]:
        if sampled is None:
            sampled = np.array(
                [self.rng.randrange(self.vocab) for _ in range(len(p.sampled_seq_ids))], dtype=np.int64
            )
        finished = self.sched.update(p, sampled)
        for sid, tok in zip(p.sampled_seq_ids.tolist(), sampled.tolist(), strict=True):
            if sid in self.live:
                self.live[sid].tokens.append(tok)
        for sid, reason, stop in finished:
            m = self.live.pop(sid)
            assert reason in (FinishReason.STOP, FinishReason.LENGTH)
            if reason == FinishReason.STOP and stop is None:
                assert m.tokens[-1] == 0
        assert self.sched.num_unfinished() == len(self.live)
        self.sched.check_invariants()
        return finished

    def step(self) -> tuple[StepPlan, list[tuple[int, FinishReason, int | None]]]:
        p = self.schedule_and_run()
        return p, self.update(p)

    def _apply_changed_rows(self, p: StepPlan) -> np.ndarray:
        """Updates the sim's table copy; returns the batch's padded block tables read through it."""
        changed, rows = p.changed_rows, p.block_table_rows
        assert changed.dtype == rows.dtype == np.int32
        assert len(set(changed.tolist())) == len(changed)
        self.table[changed] = self.sched.block_table_view()[changed]
        self.check_table()
        assert len(set(rows.tolist())) == len(rows) == len(p.req_ids)
        width = p.block_tables.shape[1]
        tables = self.table[rows, :width]
        assert np.array_equal(tables, p.block_tables)
        assert not self.table[rows, width:].any()
        return tables

    def execute(self, p: StepPlan) -> None:
        bs = self.block_size
        b = len(p.req_ids)
        assert p.num_tokens <= self.max_num_batched_tokens
        assert b <= self.max_num_seqs and len(p.sampled_seq_ids) <= self.max_num_seqs
        assert p.block_tables.shape[0] == b and p.block_tables.dtype == np.int32
        tables = self._apply_changed_rows(p)
        assert p.num_prefill_tokens + p.num_decode_tokens == p.num_tokens == len(p.input_ids)
        for name in ("swap_out", "swap_in", "copies", "block_moves"):
            assert getattr(p, name).shape[1:] == (2,)
        self.seen["preempted"] += len(p.preempted)
        self.seen["swap_out"] += len(p.swap_out)
        self.seen["copies"] += len(p.copies)
        self.seen["moves"] += len(p.block_moves)
        snap = {(int(s), o): self.mem.get(int(s) * bs + o, 0) for s, _ in p.block_moves for o in range(bs)}
        for s, d in p.block_moves.tolist():
            for o in range(bs):
                self.mem[d * bs + o] = snap[(s, o)]
        for d, s in p.swap_out.tolist():
            for o in range(bs):
                self.swap_mem[s * bs + o] = self.mem.get(d * bs + o, 0)
        for s, d in p.swap_in.tolist():
            for o in range(bs):
                self.mem[d * bs + o] = self.swap_mem.get(s * bs + o, 0)
        srcs = {s for s, _ in p.copies.tolist()}
        for s, d in p.copies.tolist():
            assert d not in srcs
            for o in range(bs):
                self.mem[d * bs + o] = self.mem.get(s * bs + o, 0)
        qsl = p.query_start_loc.tolist()
        for r, sid in enumerate(p.req_ids.tolist()):
            m = self.live[sid]
            nc, n = int(p.num_computed_tokens[r]), int(p.num_scheduled_tokens[r])
            assert qsl[r + 1] - qsl[r] == n and int(p.seq_lens[r]) == nc + n
            h = 0
            for pos in range(nc + n):
                h = _h(h, m.tokens[pos], pos)
                if pos >= nc:
                    t = qsl[r] + pos - nc
                    assert int(p.input_ids[t]) == m.tokens[pos] and int(p.positions[t]) == pos
                    slot = int(tables[r, pos // bs]) * bs + pos % bs
                    assert int(p.slot_mapping[t]) == slot
                    self.mem[slot] = h
        for r, sid in enumerate(p.req_ids.tolist()):
            m = self.live[sid]
            h = 0
            for pos in range(int(p.seq_lens[r])):
                h = _h(h, m.tokens[pos], pos)
                slot = int(tables[r, pos // bs]) * bs + pos % bs
                assert self.mem.get(slot) == h, f"seq {sid} reads wrong KV at position {pos}"
        for i, sid in enumerate(p.sampled_seq_ids.tolist()):
            t = int(p.logits_indices[i])
            assert int(p.positions[t]) == len(self.live[sid].tokens) - 1

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished() and not self.live
        self.assert_all_free()

    def assert_all_free(self) -> None:
        st = self.sched.stats()
        assert st.num_free_blocks == st.num_blocks
        assert st.num_free_swap_blocks == st.num_swap_blocks
        assert st.num_running == st.num_waiting == st.num_swapped == 0
        self.sched.check_invariants()
