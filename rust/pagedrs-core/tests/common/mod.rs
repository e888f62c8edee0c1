//! A model runner that executes plans against a simulated KV memory and checks them.
//!
//! Every slot holds a hash of the token prefix that produced it (0 = garbage). After each
//! forward, every row's whole context is read back through its block table and compared with
//! what the row's own tokens say it must be: this checks prefix hits, copy-on-write, swap and
//! resize moves end to end.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};

use pagedrs_core::spec::ngram_propose;
use pagedrs_core::{Config, FinishReason, Finished, NewRequest, Scheduler, SpecProposer, StepPlan};

pub fn prefix_hash(prev: u64, token: u32, pos: usize) -> u64 {
    let mut x = prev ^ (u64::from(token) << 20) ^ (pos as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x ^ (x >> 32)) | 1
}

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What the simulator knows about a live seq id.
#[derive(Debug, Clone)]
pub struct Mirror {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub eos: Vec<u32>,
    pub stop: Vec<u32>,
    pub min_tokens: usize,
}

pub struct Sim {
    pub s: Scheduler,
    pub cfg: Config,
    pub mem: Vec<u64>,
    pub swap_mem: Vec<u64>,
    /// The host KV tier's slots, as the runner holds them.
    pub tier_mem: Vec<u64>,
    pub tier_loads_seen: usize,
    pub live: BTreeMap<i64, Mirror>,
    pub next_id: i64,
    pub rng: Rng,
    pub vocab: u32,
    pub steps: usize,
    pub preemptions_seen: usize,
    pub copies_seen: usize,
    pub swaps_seen: usize,
    pub hits_seen: usize,
    pub moves_seen: usize,
    /// Pool capacity in tokens when the pending plan was scheduled.
    pub sched_cap: usize,
    /// The runner's copy of the persistent block table, updated from `changed_rows` only.
    pub table: Vec<i32>,
    pub width: usize,
    pub rows_changed_seen: usize,
    /// Speculating rows whose rejected drafts were rolled back.
    pub rollbacks_seen: usize,
}

impl Sim {
    pub fn new(cfg: Config, seed: u64) -> Self {
        let s = Scheduler::new(cfg.clone()).expect("valid config");
        let width = s.block_table().width();
        assert_eq!(width, cfg.max_model_len.div_ceil(cfg.block_size));
        assert_eq!(s.block_table().num_rows(), cfg.max_num_seqs);
        Self {
            table: s.block_table().as_slice().to_vec(),
            width,
            rows_changed_seen: 0,
            rollbacks_seen: 0,
            mem: vec![0; cfg.num_blocks * cfg.block_size],
            swap_mem: vec![0; cfg.num_swap_blocks * cfg.block_size],
            tier_mem: vec![0; cfg.num_tier_blocks * cfg.block_size],
            tier_loads_seen: 0,
            s,
            cfg,
            live: BTreeMap::new(),
            next_id: 1,
            rng: Rng(seed | 1),
            vocab: 8,
            steps: 0,
            preemptions_seen: 0,
            copies_seen: 0,
            swaps_seen: 0,
            hits_seen: 0,
            moves_seen: 0,
            sched_cap: 0,
        }
    }

    /// Adds a request with `n` sequences; returns the ids, or the error.
    pub fn add(
        &mut self,
        prompt: &[u32],
        n: usize,
        max_tokens: usize,
        priority: i64,
        salt: Option<String>,
        skip: bool,
    ) -> Result<Vec<i64>, pagedrs_core::Error> {
        let ids: Vec<i64> = (0..n as i64).map(|i| self.next_id + i).collect();
        let min_tokens = (self.rng.below(3) as usize).min(max_tokens);
        let req = NewRequest {
            seq_ids: ids.clone(),
            prompt_token_ids: prompt.iter().map(|&t| i64::from(t)).collect(),
            max_tokens: max_tokens as i64,
            min_tokens: min_tokens as i64,
            eos_token_ids: vec![0],
            stop_token_ids: vec![1],
            ignore_eos: false,
            priority,
            cache_salt: salt,
            skip_prefix_cache: skip,
            speculate: self.rng.below(4) != 0,
        };
        let before = self.s.stats();
        match self.s.add_request(req) {
            Ok(()) => {
                self.next_id += n as i64;
                let max_tokens = max_tokens.min(self.cfg.max_model_len - prompt.len());
                for &id in &ids {
                    self.live.insert(
                        id,
                        Mirror {
                            tokens: prompt.to_vec(),
                            prompt_len: prompt.len(),
                            max_tokens,
                            eos: vec![0],
                            stop: vec![1],
                            min_tokens: min_tokens.min(max_tokens),
                        },
                    );
                }
                Ok(ids)
            }
            Err(e) => {
                assert_eq!(
                    before,
                    self.s.stats(),
                    "a rejected request changed the state"
                );
                Err(e)
            }
        }
    }

    pub fn abort(&mut self, ids: &[i64]) {
        self.s.abort(ids);
        for id in ids {
            self.live.remove(id);
        }
    }

    /// Resizes; checks that it fails exactly when the blocks in use do not fit.
    pub fn resize(&mut self, n: usize) {
        let used = self.s.pool().num_used();
        match self.s.resize(n) {
            Ok(()) => assert!(used <= n, "resize to {n} with {used} used succeeded"),
            Err(e) => {
                assert!(used > n, "resize to {n} with {used} used failed: {e}");
                assert!(
                    e.to_string().contains(&n.to_string())
                        && e.to_string().contains(&used.to_string())
                );
            }
        }
    }

    /// schedule + execute; returns the plan (update not yet called).
    pub fn schedule_and_run(&mut self) -> StepPlan {
        self.sched_cap = self.s.num_blocks() * self.cfg.block_size;
        let p = self.s.schedule().expect("schedule");
        self.check_wire(&p);
        self.execute(&p);
        p
    }

    /// Every plan crosses the tensor-parallel step wire unchanged, with its dense block tables.
    fn check_wire(&self, p: &StepPlan) {
        let tables = self
            .s
            .padded_block_tables(p.step_id, &p.block_table_rows, p.max_blocks)
            .expect("tables of the plan just made");
        let extra: Vec<i64> = (0..p.num_tokens as i64).step_by(3).collect();
        let (header, payload) = p.to_wire(&tables, &extra);
        let back = StepPlan::from_wire(&header, &payload).expect("a plan's own wire message");
        assert_eq!(&back.plan, p);
        assert_eq!(back.block_tables, tables);
        assert_eq!(back.extra_logits_indices, extra);
    }

    /// update with random tokens; checks the finished list against the mirrors. A speculating
    /// sequence accepts a random number of its drafts, then emits a random token.
    pub fn update(&mut self, p: &StepPlan) -> Vec<Finished> {
        if p.num_draft_tokens.iter().all(|&d| d == 0) {
            let sampled: Vec<i64> = (0..p.sampled_seq_ids.len())
                .map(|_| self.rng.below(u64::from(self.vocab)) as i64)
                .collect();
            return self.update_with(p, &sampled);
        }
        let (mut tokens, mut counts) = (Vec::new(), Vec::new());
        let mut at = 0usize;
        for &d in &p.num_draft_tokens {
            let d = d as usize;
            let a = self.rng.below(d as u64 + 1) as usize;
            tokens.extend_from_slice(&p.draft_token_ids[at..at + a]);
            tokens.push(self.rng.below(u64::from(self.vocab)) as i64);
            counts.push(a as i32 + 1);
            if a < d {
                self.rollbacks_seen += 1;
            }
            at += d;
        }
        let (fin, kept) = self
            .s
            .update_spec(p.step_id, &tokens, &counts)
            .expect("update_spec");
        let mut at = 0usize;
        for (i, &id) in p.sampled_seq_ids.iter().enumerate() {
            let c = counts[i] as usize;
            let k = kept[i] as usize;
            assert!(k <= c);
            if let Some(m) = self.live.get_mut(&id) {
                assert!(k >= 1, "a live sequence kept none of its tokens");
                m.tokens
                    .extend(tokens[at..at + k].iter().map(|&t| t as u32));
            }
            at += c;
        }
        self.check_finished(fin)
    }

    pub fn update_with(&mut self, p: &StepPlan, sampled: &[i64]) -> Vec<Finished> {
        let fin = self.s.update(p.step_id, sampled).expect("update");
        for (i, &id) in p.sampled_seq_ids.iter().enumerate() {
            if let Some(m) = self.live.get_mut(&id) {
                m.tokens.push(sampled[i] as u32);
            }
        }
        self.check_finished(fin)
    }

    fn check_finished(&mut self, fin: Vec<Finished>) -> Vec<Finished> {
        let finished_ids: HashSet<i64> = fin.iter().map(|f| f.seq_id).collect();
        assert_eq!(finished_ids.len(), fin.len(), "a seq finished twice");
        for f in &fin {
            let m = self.live.remove(&f.seq_id).expect("finished seq was live");
            let out = m.tokens.len() - m.prompt_len;
            let last = *m.tokens.last().unwrap();
            match (f.reason, f.stop_token) {
                (FinishReason::Stop, None) => assert!(m.eos.contains(&last) && out >= m.min_tokens),
                (FinishReason::Stop, Some(t)) => {
                    assert!(t == i64::from(last) && m.stop.contains(&last) && out >= m.min_tokens)
                }
                (FinishReason::Length, _) => {
                    let cap = self.sched_cap;
                    assert!(
                        out >= m.max_tokens
                            || m.tokens.len() >= self.cfg.max_model_len
                            || m.tokens.len() > cap,
                        "seq {} finished by length early: {out} outputs of {}",
                        f.seq_id,
                        m.max_tokens
                    );
                }
            }
        }
        // Everything still live must still be known to the scheduler, and vice versa.
        assert_eq!(self.s.num_unfinished(), self.live.len(), "unfinished count");
        self.s.check_invariants().unwrap();
        fin
    }

    pub fn step(&mut self) -> (StepPlan, Vec<Finished>) {
        let p = self.schedule_and_run();
        let f = self.update(&p);
        (p, f)
    }

    /// The runner's copy of the block table equals the scheduler's.
    pub fn check_mirror(&self) {
        assert!(
            self.table == self.s.block_table().as_slice(),
            "the runner's block table (changed rows applied) differs from the scheduler's"
        );
    }

    /// Copies the plan's changed rows, as a runner does to its device table; checks every batch
    /// row against its sequence's block table.
    fn apply_changed_rows(&mut self, p: &StepPlan) {
        let w = self.width;
        let num_rows = self.s.block_table().num_rows();
        let mut seen = HashSet::new();
        for &r in &p.changed_rows {
            assert!((r as usize) < num_rows, "changed row {r} out of range");
            assert!(seen.insert(r), "changed row {r} repeats");
            let r = r as usize;
            self.table[r * w..(r + 1) * w].copy_from_slice(self.s.block_table().row(r as u32));
        }
        self.rows_changed_seen += p.changed_rows.len();
        self.check_mirror();
        let b = p.req_ids.len();
        assert_eq!(p.block_table_rows.len(), b);
        let rows: HashSet<i32> = p.block_table_rows.iter().copied().collect();
        assert_eq!(rows.len(), b, "two batch entries share a block-table row");
        let mut max_blocks = 0;
        for (&id, &r) in p.req_ids.iter().zip(&p.block_table_rows) {
            let blocks = self.s.block_table_of(id).expect("scheduled seq is live");
            let row = &self.table[r as usize * w..(r as usize + 1) * w];
            let n = blocks.len();
            max_blocks = max_blocks.max(n);
            assert!(
                row[..n].iter().zip(blocks).all(|(&a, &b)| a == b as i32)
                    && row[n..].iter().all(|&x| x == 0),
                "row {r} of seq {id} is not its block table {blocks:?}"
            );
        }
        assert_eq!(p.max_blocks, max_blocks);
        let padded = self.s.plan_block_tables(p).expect("fresh plan");
        assert_eq!(padded.len(), b * max_blocks);
        for (i, &r) in p.block_table_rows.iter().enumerate() {
            let r = r as usize * w;
            assert_eq!(
                padded[i * max_blocks..(i + 1) * max_blocks],
                self.table[r..r + max_blocks]
            );
        }
    }

    /// Runs the plan's block ops and forward on the simulated memory, checking everything.
    pub fn execute(&mut self, p: &StepPlan) {
        self.apply_changed_rows(p);
        let bs = self.cfg.block_size;
        let w = self.width;
        self.steps += 1;
        self.preemptions_seen += p.preempted.len();
        self.copies_seen += p.copies.len() / 2;
        self.swaps_seen += p.swap_out.len() / 2;
        self.moves_seen += p.block_moves.len() / 2;
        // Shapes and limits.
        let b = p.req_ids.len();
        let t = p.num_tokens;
        assert!(
            t <= self.cfg.max_num_batched_tokens,
            "token budget: {t} > {}",
            self.cfg.max_num_batched_tokens
        );
        assert!(
            b <= self.cfg.max_num_seqs && p.sampled_seq_ids.len() <= self.cfg.max_num_seqs,
            "max_num_seqs"
        );
        assert_eq!(p.input_ids.len(), t);
        assert_eq!(p.positions.len(), t);
        assert_eq!(p.slot_mapping.len(), t);
        assert_eq!(p.query_start_loc.len(), b + 1);
        assert_eq!(p.num_prefill_tokens + p.num_decode_tokens, t);
        assert_eq!(p.num_draft_tokens.len(), p.sampled_seq_ids.len());
        let num_drafts: usize = p.num_draft_tokens.iter().map(|&d| d as usize).sum();
        assert_eq!(p.draft_token_ids.len(), num_drafts);
        assert_eq!(p.logits_indices.len(), p.sampled_seq_ids.len() + num_drafts);
        // Each speculating sequence's tokens as the forward sees them: its own, then its drafts.
        let mut virt: BTreeMap<i64, Vec<u32>> = BTreeMap::new();
        let mut at = 0usize;
        for (i, &id) in p.sampled_seq_ids.iter().enumerate() {
            let d = p.num_draft_tokens[i] as usize;
            if d == 0 {
                continue;
            }
            assert!(self.cfg.num_speculative_tokens >= d, "too many drafts");
            let m = &self.live[&id];
            let drafts = &p.draft_token_ids[at..at + d];
            at += d;
            assert!(
                m.tokens.len() - m.prompt_len + d < m.max_tokens,
                "drafts past max_tokens"
            );
            assert!(
                m.tokens.len() + d < self.cfg.max_model_len,
                "drafts past max_model_len"
            );
            match self.cfg.spec_proposer {
                SpecProposer::Ngram { min, max } => {
                    let want = ngram_propose(&m.tokens, min, max, usize::MAX);
                    assert_eq!(
                        &want[..d].iter().map(|&x| i64::from(x)).collect::<Vec<_>>(),
                        drafts
                    );
                }
                SpecProposer::Runner => {
                    assert!(drafts
                        .iter()
                        .all(|&x| x == i64::from(*m.tokens.last().unwrap())));
                }
            }
            let mut v = m.tokens.clone();
            v.extend(drafts.iter().map(|&x| x as u32));
            virt.insert(id, v);
        }
        let rows: HashSet<i64> = p.req_ids.iter().copied().collect();
        assert_eq!(rows.len(), b, "a seq appears twice in one batch");
        // Pool resize and block ops, in the runner's order.
        let nb = p.num_blocks;
        if nb * bs > self.mem.len() {
            self.mem.resize(nb * bs, 0);
        }
        // Tier stores read the pool before anything in this plan writes it.
        for m in p.tier_store.chunks_exact(2) {
            let (d, s) = (m[0] as usize, m[1] as usize);
            for o in 0..bs {
                self.tier_mem[s * bs + o] = self.mem[d * bs + o];
            }
        }
        // Moves run as one gather-then-scatter: sources read the pool as the last plan left it.
        let mut move_dsts = HashSet::new();
        let snapshot: Vec<Vec<u64>> = p
            .block_moves
            .chunks_exact(2)
            .map(|c| self.mem[c[0] as usize * bs..(c[0] as usize + 1) * bs].to_vec())
            .collect();
        for (m, data) in p.block_moves.chunks_exact(2).zip(snapshot) {
            assert!(move_dsts.insert(m[1]), "move destination {} repeats", m[1]);
            assert!(
                (m[1] as usize) < nb,
                "move into block {} >= pool {nb}",
                m[1]
            );
            let d = m[1] as usize;
            self.mem[d * bs..(d + 1) * bs].copy_from_slice(&data);
        }
        let mut dsts = HashSet::new();
        for m in p.swap_out.chunks_exact(2) {
            let (d, s) = (m[0] as usize, m[1] as usize);
            assert!(
                dsts.insert(("swap", s)),
                "swap block {s} written twice in one step"
            );
            for o in 0..bs {
                self.swap_mem[s * bs + o] = self.mem[d * bs + o];
            }
        }
        for m in p.swap_in.chunks_exact(2) {
            let (s, d) = (m[0] as usize, m[1] as usize);
            assert!(d < nb);
            for o in 0..bs {
                self.mem[d * bs + o] = self.swap_mem[s * bs + o];
            }
        }
        self.tier_loads_seen += p.tier_load.len() / 2;
        for m in p.tier_load.chunks_exact(2) {
            let (s, d) = (m[0] as usize, m[1] as usize);
            assert!(d < nb);
            for o in 0..bs {
                self.mem[d * bs + o] = self.tier_mem[s * bs + o];
            }
        }
        // Copies run in parallel on a GPU: no destination may be a source or repeat.
        let srcs: HashSet<i64> = p.copies.chunks_exact(2).map(|c| c[0]).collect();
        let mut copy_dsts = HashSet::new();
        let snapshot: Vec<Vec<u64>> = p
            .copies
            .chunks_exact(2)
            .map(|c| self.mem[c[0] as usize * bs..(c[0] as usize + 1) * bs].to_vec())
            .collect();
        for (c, data) in p.copies.chunks_exact(2).zip(snapshot) {
            assert!(
                !srcs.contains(&c[1]) && copy_dsts.insert(c[1]),
                "copy destination {} is reused",
                c[1]
            );
            let d = c[1] as usize;
            self.mem[d * bs..(d + 1) * bs].copy_from_slice(&data);
        }
        // Forward: write every new token's slot, then read every row's context.
        let mut all_slots = HashSet::new();
        for r in 0..b {
            let id = p.req_ids[r];
            let m = self
                .live
                .get(&id)
                .unwrap_or_else(|| panic!("plan row for unknown seq {id}"));
            let m_tokens = virt.get(&id).unwrap_or(&m.tokens);
            let nc = p.num_computed_tokens[r] as usize;
            let n = p.num_scheduled_tokens[r] as usize;
            assert!(n > 0);
            assert_eq!(p.seq_lens[r] as usize, nc + n);
            assert_eq!(p.num_prompt_tokens[r] as usize, m.prompt_len);
            assert!(
                nc + n <= m_tokens.len(),
                "seq {id} schedules past its tokens"
            );
            let q0 = p.query_start_loc[r] as usize;
            assert_eq!(p.query_start_loc[r + 1] as usize, q0 + n);
            let rr = p.block_table_rows[r] as usize;
            let row = &self.table[rr * w..(rr + 1) * w];
            let mut h = 0u64;
            for (pos, &tok) in m_tokens.iter().enumerate().take(nc) {
                h = prefix_hash(h, tok, pos);
            }
            for j in 0..n {
                let pos = nc + j;
                h = prefix_hash(h, m_tokens[pos], pos);
                assert_eq!(p.input_ids[q0 + j], i64::from(m_tokens[pos]));
                assert_eq!(p.positions[q0 + j], pos as i64);
                let blk = row[pos / bs] as usize;
                assert!(blk < nb, "block {blk} >= pool {nb}");
                let slot = blk * bs + pos % bs;
                assert_eq!(p.slot_mapping[q0 + j], slot as i64);
                assert!(
                    all_slots.insert(slot),
                    "slot {slot} written twice in one step"
                );
                self.mem[slot] = h;
            }
        }
        for r in 0..b {
            let id = p.req_ids[r];
            let m = &self.live[&id];
            let m_tokens = virt.get(&id).unwrap_or(&m.tokens);
            let len = p.seq_lens[r] as usize;
            let rr = p.block_table_rows[r] as usize;
            let row = &self.table[rr * w..(rr + 1) * w];
            let mut h = 0u64;
            for (pos, &tok) in m_tokens.iter().enumerate().take(len) {
                h = prefix_hash(h, tok, pos);
                let slot = row[pos / bs] as usize * bs + pos % bs;
                assert_eq!(
                    self.mem[slot], h,
                    "seq {id} reads wrong KV at position {pos} (step {})",
                    p.step_id
                );
            }
            if p.num_computed_tokens[r] > 0 && m.tokens.len() == m.prompt_len {
                self.hits_seen += 1;
            }
        }
        // Logits rows sample the last known token of their sequence (then each draft).
        let mut li = 0usize;
        for (i, &id) in p.sampled_seq_ids.iter().enumerate() {
            let m = &self.live[&id];
            let m_tokens = virt.get(&id).unwrap_or(&m.tokens);
            for j in 0..=p.num_draft_tokens[i] as usize {
                let idx = p.logits_indices[li] as usize;
                li += 1;
                assert!(idx < t);
                let pos = m.tokens.len() - 1 + j;
                assert_eq!(p.positions[idx] as usize, pos, "logits row of seq {id}");
                assert_eq!(p.input_ids[idx], i64::from(m_tokens[pos]));
            }
        }
        if nb * bs < self.mem.len() {
            self.mem.truncate(nb * bs);
        }
    }

    /// Steps until nothing is unfinished; panics if that takes more than `max_steps`.
    pub fn drain(&mut self, max_steps: usize) {
        let mut n = 0;
        while self.s.has_unfinished() {
            n += 1;
            assert!(
                n <= max_steps,
                "no progress after {max_steps} steps: {:?}",
                self.s.stats()
            );
            self.step();
        }
        assert!(
            self.live.is_empty(),
            "live mirrors left: {:?}",
            self.live.keys()
        );
        self.assert_all_free();
    }

    pub fn assert_all_free(&self) {
        let st = self.s.stats();
        assert_eq!(st.num_free_blocks, st.num_blocks, "blocks leaked");
        assert_eq!(
            st.num_free_swap_blocks, st.num_swap_blocks,
            "swap blocks leaked"
        );
        assert_eq!((st.num_running, st.num_waiting, st.num_swapped), (0, 0, 0));
        self.s.check_invariants().unwrap();
    }
}
