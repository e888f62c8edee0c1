//! The scheduler's state and its small operations: add, abort, queries, stats.
//! The step itself lives in `schedule.rs` (decisions), `plan.rs` (arrays) and `update.rs`.

use std::collections::{BTreeSet, HashMap};

use crate::block_pool::BlockPool;
use crate::block_table::BlockTable;
use crate::config::{to_token_ids, Config, NewRequest};
use crate::error::{Error, Result};
use crate::prefix_cache::extra_key_of;
use crate::request::{Finished, Seq, SeqKey, Status, StopParams};
use crate::swap_pool::SwapPool;

/// Where a Python-visible seq id lives: its own slot, or a child waiting to fork from `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SeqRef {
    pub slot: u32,
    pub child: bool,
}

/// Counters and gauges, as `stats()` reports them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_swapped: usize,
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    /// The fullest pool's usage (0..1): the full-attention pool's, or a KV-cache group's when one is
    /// fuller (the pool that limits admission).
    pub kv_usage: f64,
    /// Each KV-cache group's pool usage, in group order.
    pub group_kv_usage: Vec<f64>,
    pub num_swap_blocks: usize,
    pub num_free_swap_blocks: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    /// Speculative decoding: verification rows (sequences that speculated, summed over steps), draft
    /// tokens proposed, and draft tokens accepted.
    pub spec_num_drafts: u64,
    pub spec_num_draft_tokens: u64,
    pub spec_num_accepted_tokens: u64,
    /// Engine-wide pauses of speculation measured slower than plain decoding (`spec_governor`).
    pub spec_num_pauses: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    pub(crate) cfg: Config,
    pub(crate) pool: BlockPool,
    pub(crate) swap: SwapPool,
    /// Persistent block table: one row per running sequence (`Seq::row`).
    pub(crate) tables: BlockTable,
    pub(crate) seqs: Vec<Seq>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) ids: HashMap<i64, SeqRef>,
    // INVARIANT: sorted by key; victims of preemption are taken from the end.
    pub(crate) running: Vec<u32>,
    pub(crate) waiting: BTreeSet<(SeqKey, u32)>,
    pub(crate) swapped: BTreeSet<(SeqKey, u32)>,
    /// Sum of `width()` over running sequences (children not yet forked count).
    pub(crate) num_running_seqs: usize,
    pub(crate) watermark_blocks: usize,
    next_arrival: u64,
    pub(crate) step: u64,
    /// Step id of the plan whose `update()` is outstanding.
    pub(crate) pending: Option<u64>,
    /// (slot, gen) of the pending plan's rows and of its logits rows.
    pub(crate) rows: Vec<(u32, u32)>,
    pub(crate) samples: Vec<(u32, u32)>,
    /// Sequences finished by `schedule()` (the pool can never hold them); reported by `update()`.
    pub(crate) pending_finished: Vec<Finished>,
    /// Resize moves not yet handed to a plan, flattened (src, dst) pairs.
    pub(crate) pending_moves: Vec<i64>,
    pub(crate) prefix_queries: u64,
    pub(crate) prefix_hits: u64,
    pub(crate) num_preemptions: u64,
    pub(crate) spec_counts: [u64; 3],
    pub(crate) spec_governor: crate::spec_governor::SpecGovernor,
    /// The shape of the last planned step (its emitted tokens set by `update()`), until
    /// `observe_step_time()` takes it.
    pub(crate) step_shape: Option<crate::spec_governor::StepShape>,
    /// Scratch reused every step: (slot, num_new) in batch order.
    pub(crate) sched: Vec<(u32, usize)>,
    pub(crate) hit_scratch: Vec<u32>,
    pub(crate) cache_scratch: Vec<crate::block_pool::CacheItem>,
    /// The KV-cache groups beside the primary pool (`kv_groups`): other kinds of layer state.
    pub(crate) kv: crate::kv_groups::KvGroups,
}

impl Scheduler {
    pub fn new(cfg: Config) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            pool: BlockPool::new(cfg.num_blocks, cfg.block_size),
            swap: SwapPool::new(cfg.num_swap_blocks),
            // Rows belong to running sequences only, and those never exceed max_num_seqs
            // (children not yet forked included), so this size is final.
            tables: BlockTable::new(cfg.max_num_seqs, cfg.max_model_len.div_ceil(cfg.block_size)),
            watermark_blocks: cfg.watermark_blocks(cfg.num_blocks),
            cfg,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            running: Vec::new(),
            waiting: BTreeSet::new(),
            swapped: BTreeSet::new(),
            num_running_seqs: 0,
            next_arrival: 0,
            step: 0,
            pending: None,
            rows: Vec::new(),
            samples: Vec::new(),
            pending_finished: Vec::new(),
            pending_moves: Vec::new(),
            prefix_queries: 0,
            prefix_hits: 0,
            num_preemptions: 0,
            spec_counts: [0; 3],
            spec_governor: Default::default(),
            step_shape: None,
            sched: Vec::new(),
            hit_scratch: Vec::new(),
            cache_scratch: Vec::new(),
            kv: Default::default(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn max_model_len(&self) -> usize {
        self.cfg.max_model_len
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Adds one request; `seq_ids[1..]` fork from `seq_ids[0]` once its prompt is computed.
    pub fn add_request(&mut self, req: NewRequest) -> Result<()> {
        let n = req.seq_ids.len();
        if n == 0 {
            return Err(Error::InvalidRequest("seq_ids is empty".into()));
        }
        if n > self.cfg.max_num_seqs {
            return Err(Error::InvalidRequest(format!(
                "{n} sequences in one request exceed max_num_seqs {}",
                self.cfg.max_num_seqs
            )));
        }
        for (i, &id) in req.seq_ids.iter().enumerate() {
            if self.ids.contains_key(&id) || req.seq_ids[..i].contains(&id) {
                return Err(Error::DuplicateSeqId { seq_id: id });
            }
        }
        let prompt_len = req.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(Error::EmptyPrompt {
                seq_id: req.seq_ids[0],
            });
        }
        let tokens = to_token_ids(&req.prompt_token_ids, self.cfg.vocab_size)?;
        let eos_token_ids = to_token_ids(&req.eos_token_ids, None)?;
        let stop_token_ids = to_token_ids(&req.stop_token_ids, None)?;
        if req.max_tokens < 1 {
            return Err(Error::InvalidRequest(format!(
                "max_tokens must be >= 1, got {}",
                req.max_tokens
            )));
        }
        if req.min_tokens < 0 || req.min_tokens > req.max_tokens {
            return Err(Error::InvalidRequest(format!(
                "min_tokens must be in [0, max_tokens={}], got {}",
                req.max_tokens, req.min_tokens
            )));
        }
        let max_model_len = self.cfg.max_model_len;
        if prompt_len + 1 > max_model_len {
            return Err(Error::PromptTooLong {
                prompt_len,
                max_model_len,
            });
        }
        let needed = prompt_len.div_ceil(self.cfg.block_size);
        if needed > self.pool.num_blocks() {
            return Err(Error::PromptExceedsPool {
                prompt_len,
                needed,
                num_blocks: self.pool.num_blocks(),
            });
        }
        let max_tokens = (req.max_tokens as u64).min((max_model_len - prompt_len) as u64) as usize;
        let stop = StopParams::new(
            max_tokens,
            (req.min_tokens as usize).min(max_tokens),
            eos_token_ids,
            stop_token_ids,
            req.ignore_eos,
        );
        let key = SeqKey {
            priority: req.priority,
            arrival: self.next_arrival,
            child: 0,
        };
        self.next_arrival += 1;
        let slot = self.new_slot();
        let seq = &mut self.seqs[slot as usize];
        seq.seq_id = req.seq_ids[0];
        seq.status = Status::Waiting;
        seq.key = key;
        seq.last_token = *tokens.last().expect("non-empty prompt");
        seq.tokens = tokens;
        seq.prompt_len = prompt_len;
        seq.extra_key = req.cache_salt.as_deref().map_or(0, extra_key_of);
        seq.skip_prefix_cache = req.skip_prefix_cache;
        seq.speculate = req.speculate;
        seq.drafts.clear();
        seq.stop = stop;
        seq.children = req.seq_ids[1..]
            .iter()
            .zip(1u32..)
            .map(|(&id, c)| (id, c))
            .collect();
        self.ids
            .insert(req.seq_ids[0], SeqRef { slot, child: false });
        for &id in &req.seq_ids[1..] {
            self.ids.insert(id, SeqRef { slot, child: true });
        }
        self.waiting.insert((key, slot));
        Ok(())
    }

    /// Aborts sequences in any state, freeing everything they hold. Unknown ids are ignored.
    pub fn abort(&mut self, seq_ids: &[i64]) {
        if !self.pending_finished.is_empty() {
            self.pending_finished
                .retain(|f| !seq_ids.contains(&f.seq_id));
        }
        for &id in seq_ids {
            let Some(r) = self.ids.remove(&id) else {
                continue;
            };
            let slot = r.slot as usize;
            let running = self.seqs[slot].status == Status::Running;
            if r.child {
                self.seqs[slot].children.retain(|&(c, _)| c != id);
                if running {
                    self.num_running_seqs -= 1;
                }
            } else if !self.seqs[slot].children.is_empty() {
                // The first child takes over the prefill; queue positions keep the same key.
                let seq = &mut self.seqs[slot];
                let (child, _) = seq.children.remove(0);
                seq.seq_id = child;
                self.ids.insert(
                    child,
                    SeqRef {
                        slot: r.slot,
                        child: false,
                    },
                );
                if running {
                    self.num_running_seqs -= 1;
                }
            } else {
                self.remove_seq(r.slot);
            }
        }
    }

    /// Frees everything sequence `slot` holds and takes it out of its queue and the id map.
    pub(crate) fn remove_seq(&mut self, slot: u32) {
        let seq = &mut self.seqs[slot as usize];
        debug_assert!(seq.alive && seq.children.is_empty());
        match seq.status {
            Status::Running => {
                let key = seq.key;
                let seqs = &self.seqs;
                let pos = self
                    .running
                    .binary_search_by(|&s| seqs[s as usize].key.cmp(&key))
                    .expect("running sequence is in the running list");
                self.running.remove(pos);
                self.num_running_seqs -= 1;
            }
            Status::Waiting => {
                self.waiting.remove(&(seq.key, slot));
            }
            Status::Swapped => {
                self.swapped.remove(&(seq.key, slot));
            }
        }
        self.release_slot(slot);
    }

    /// Frees the blocks of `slot`, forgets its id and recycles the slot. Queues are the caller's.
    pub(crate) fn release_slot(&mut self, slot: u32) {
        self.kv.free(slot);
        let seq = &mut self.seqs[slot as usize];
        if let Some(row) = seq.row.take() {
            self.tables.release(row);
        }
        self.pool.free_table(&seq.block_table);
        for &s in &seq.swap_table {
            self.swap.free(s);
        }
        seq.block_table.clear();
        seq.last_block = 0;
        seq.swap_table.clear();
        seq.alive = false;
        seq.gen = seq.gen.wrapping_add(1);
        if self
            .ids
            .get(&seq.seq_id)
            .is_some_and(|r| r.slot == slot && !r.child)
        {
            self.ids.remove(&seq.seq_id);
        }
        self.free_slots.push(slot);
    }

    /// A fresh (or recycled, keeping its buffers) sequence slot, marked alive.
    pub(crate) fn new_slot(&mut self) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.seqs.push(Seq {
                    seq_id: 0,
                    gen: 0,
                    last_block: 0,
                    row: None,
                    alive: false,
                    status: Status::Waiting,
                    key: SeqKey {
                        priority: 0,
                        arrival: 0,
                        child: 0,
                    },
                    tokens: Vec::new(),
                    prompt_len: 0,
                    num_computed: 0,
                    block_table: Vec::new(),
                    swap_table: Vec::new(),
                    last_hash: 0,
                    num_cached_blocks: 0,
                    extra_key: 0,
                    skip_prefix_cache: false,
                    stop: StopParams::default(),
                    last_token: 0,
                    tail: [0; crate::request::TAIL],
                    tail_len: 0,
                    shared_tail: false,
                    children: Vec::new(),
                    num_cached_tokens: 0,
                    admitted: false,
                    speculate: false,
                    drafts: Vec::new(),
                    spec_len: 0,
                    spec_skip: 0,
                    spec_misses: 0,
                });
                (self.seqs.len() - 1) as u32
            }
        };
        let seq = &mut self.seqs[slot as usize];
        seq.alive = true;
        seq.tokens.clear();
        seq.tail_len = 0;
        seq.num_computed = 0;
        seq.shared_tail = false;
        seq.num_cached_blocks = 0;
        seq.children.clear();
        seq.num_cached_tokens = 0;
        seq.admitted = false;
        seq.speculate = false;
        seq.drafts.clear();
        seq.spec_len = 0;
        seq.spec_skip = 0;
        seq.spec_misses = 0;
        slot
    }

    /// Inserts `slot` into the running list at its key's place and gives it a block-table row.
    pub(crate) fn insert_running(&mut self, slot: u32) {
        debug_assert!(self.seqs[slot as usize].row.is_none());
        self.seqs[slot as usize].row = Some(self.tables.acquire(slot));
        let key = self.seqs[slot as usize].key;
        let seqs = &self.seqs;
        let pos = self
            .running
            .binary_search_by(|&s| seqs[s as usize].key.cmp(&key))
            .unwrap_or_else(|p| p);
        self.running.insert(pos, slot);
    }

    pub fn has_unfinished(&self) -> bool {
        !self.ids.is_empty() || !self.pending_finished.is_empty()
    }

    /// Seq ids not finished (or finished but not yet reported by `update()`).
    pub fn num_unfinished(&self) -> usize {
        self.ids.len() + self.pending_finished.len()
    }

    /// Prefix-cache hit tokens at the first admission of `seq_id`'s request.
    pub fn num_cached_tokens(&self, seq_id: i64) -> Result<usize> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(self.seqs[r.slot as usize].num_cached_tokens)
    }

    /// Status of a live seq id (children not yet forked report their parent's).
    pub fn status(&self, seq_id: i64) -> Result<Status> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(self.seqs[r.slot as usize].status)
    }

    /// Token ids (prompt + output, the newest output tokens included) of a live seq id; a child
    /// not yet forked has its parent's prompt and no output.
    pub fn token_ids(&self, seq_id: i64) -> Result<Vec<u32>> {
        self.tokens_from(seq_id, 0)
    }

    /// Output token ids of a live seq id: the one copy the engine keeps (penalties, min_tokens and
    /// the batch picture read it from here).
    pub fn output_token_ids(&self, seq_id: i64) -> Result<Vec<u32>> {
        self.tokens_from(seq_id, usize::MAX)
    }

    /// `output_token_ids(seq_id).len()` without the copy.
    pub fn num_output_tokens(&self, seq_id: i64) -> Result<usize> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(if r.child {
            0
        } else {
            self.seqs[r.slot as usize].num_output()
        })
    }

    /// Tokens of a live seq id from position `start` (`usize::MAX`: from the end of the prompt).
    fn tokens_from(&self, seq_id: i64, start: usize) -> Result<Vec<u32>> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        let seq = &self.seqs[r.slot as usize];
        let start = start.min(seq.prompt_len);
        let end = if r.child {
            seq.prompt_len
        } else {
            seq.num_tokens()
        };
        Ok((start..end).map(|i| seq.token(i)).collect())
    }

    /// Device blocks of a live seq id (empty for a child not yet forked).
    pub fn block_table_of(&self, seq_id: i64) -> Result<&[u32]> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(if r.child {
            &[]
        } else {
            &self.seqs[r.slot as usize].block_table
        })
    }

    /// Drops every prefix-cache entry; false (nothing done) while blocks are in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.kv.is_idle() || !self.pool.reset_prefix_cache() {
            return false;
        }
        self.kv.reset_prefix_cache()
    }

    pub fn stats(&self) -> Stats {
        let group_usage: Vec<f64> = self.kv.stats().iter().map(|g| g.kv_usage).collect();
        let width = |set: &BTreeSet<(SeqKey, u32)>| -> usize {
            set.iter()
                .map(|&(_, s)| self.seqs[s as usize].width())
                .sum()
        };
        Stats {
            num_running: self.num_running_seqs,
            num_waiting: width(&self.waiting),
            num_swapped: width(&self.swapped),
            num_blocks: self.pool.num_blocks(),
            num_free_blocks: self.pool.num_free(),
            kv_usage: group_usage.iter().fold(self.pool.usage(), |a, &b| a.max(b)),
            group_kv_usage: group_usage,
            num_swap_blocks: self.swap.num_blocks(),
            num_free_swap_blocks: self.swap.num_free(),
            prefix_cache_queries: self.prefix_queries,
            prefix_cache_hits: self.prefix_hits,
            num_preemptions: self.num_preemptions,
            spec_num_drafts: self.spec_counts[0],
            spec_num_draft_tokens: self.spec_counts[1],
            spec_num_accepted_tokens: self.spec_counts[2],
            spec_num_pauses: self.spec_governor.num_pauses(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched() -> Scheduler {
        Scheduler::new(Config {
            num_blocks: 4,
            block_size: 4,
            max_model_len: 32,
            ..Config::default()
        })
        .unwrap()
    }

    fn req(ids: &[i64], len: usize) -> NewRequest {
        NewRequest {
            seq_ids: ids.to_vec(),
            prompt_token_ids: (1..=len as i64).collect(),
            max_tokens: 4,
            ..Default::default()
        }
    }

    #[test]
    fn rejections_leave_no_trace() {
        let mut s = sched();
        let e = s.add_request(req(&[1], 32)).unwrap_err();
        assert!(
            e.to_string().contains("33") && e.to_string().contains("32"),
            "{e}"
        );
        let e = s.add_request(req(&[1], 17)).unwrap_err();
        assert!(
            e.to_string().contains("5 blocks") && e.to_string().contains("only 4"),
            "{e}"
        );
        assert!(matches!(
            s.add_request(req(&[1, 1], 3)),
            Err(Error::DuplicateSeqId { seq_id: 1 })
        ));
        assert!(matches!(
            s.add_request(req(&[1], 0)),
            Err(Error::EmptyPrompt { .. })
        ));
        assert!(!s.has_unfinished());
        s.check_invariants().unwrap();
    }

    #[test]
    fn max_tokens_is_clipped_to_max_model_len() {
        let cfg = Config {
            num_blocks: 16,
            block_size: 4,
            max_model_len: 32,
            ..Config::default()
        };
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request(NewRequest {
            max_tokens: 1000,
            ..req(&[1], 30)
        })
        .unwrap();
        let slot = s.ids[&1].slot as usize;
        assert_eq!(s.seqs[slot].stop.max_tokens, 2);
    }

    #[test]
    fn aborting_a_parent_promotes_its_first_child() {
        let mut s = sched();
        s.add_request(req(&[1, 2, 3], 3)).unwrap();
        assert_eq!(s.num_unfinished(), 3);
        s.abort(&[1]);
        assert_eq!(s.status(2).unwrap(), Status::Waiting);
        assert_eq!(s.stats().num_waiting, 2);
        s.abort(&[3, 99]);
        s.check_invariants().unwrap();
        let p = s.schedule().unwrap();
        assert_eq!(p.req_ids, vec![2]);
        assert_eq!(p.sampled_seq_ids, vec![2]);
        s.abort(&[2]);
        assert!(!s.has_unfinished());
        assert_eq!(s.pool().num_free(), 4);
    }

    #[test]
    fn output_token_ids_include_the_newest_tokens_across_tail_flushes() {
        let mut s = Scheduler::new(Config {
            num_blocks: 16,
            block_size: 4,
            max_model_len: 64,
            ..Config::default()
        })
        .unwrap();
        s.add_request(NewRequest {
            max_tokens: 40,
            ..req(&[7, 8], 3)
        })
        .unwrap();
        let mut want: Vec<u32> = Vec::new();
        for step in 0..37u32 {
            let p = s.schedule().unwrap();
            let sampled: Vec<i64> = (0..p.sampled_seq_ids.len())
                .map(|i| i64::from(100 + step * 2 + i as u32))
                .collect();
            let row = p.sampled_seq_ids.iter().position(|&id| id == 7).unwrap();
            want.push(sampled[row] as u32);
            s.update(p.step_id, &sampled).unwrap();
            assert_eq!(s.output_token_ids(7).unwrap(), want, "step {step}");
            assert_eq!(s.num_output_tokens(7).unwrap(), want.len());
            let mut all = vec![1, 2, 3];
            all.extend(&want);
            assert_eq!(s.token_ids(7).unwrap(), all);
        }
        assert!(matches!(
            s.output_token_ids(99),
            Err(Error::UnknownSeqId { seq_id: 99 })
        ));
    }

    #[test]
    fn token_ids_and_cached_tokens_queries() {
        let mut s = sched();
        s.add_request(req(&[1, 2], 3)).unwrap();
        assert_eq!(s.token_ids(2).unwrap(), vec![1, 2, 3]);
        assert_eq!(s.output_token_ids(2).unwrap(), Vec::<u32>::new());
        assert_eq!(s.num_output_tokens(2).unwrap(), 0);
        assert_eq!(s.num_cached_tokens(1).unwrap(), 0);
        assert!(matches!(
            s.num_cached_tokens(5),
            Err(Error::UnknownSeqId { seq_id: 5 })
        ));
    }
}
