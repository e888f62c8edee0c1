//! The scheduler's state and its small operations: add, abort; its read-only queries and stats are in
//! `queries.rs`.
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
    /// The host KV tier's slots, those in use, and its counters (`kv_tier`).
    pub num_tier_blocks: usize,
    pub num_used_tier_blocks: usize,
    pub tier: crate::kv_tier::TierCounters,
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
    /// The external KV tier behind the device pool, through the connector interface
    /// (`kv_connector`; the host KV tier): it keeps the store transfers the next plan carries.
    pub(crate) tier: Box<dyn crate::kv_connector::KvConnector>,
    /// Persistent block table: one row per running sequence (`Seq::row`).
    pub(crate) tables: BlockTable,
    pub(crate) seqs: Vec<Seq>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) ids: HashMap<i64, SeqRef>,
    /// Prompt ranges a prefill chunk takes whole (`atomic_spans`), by sequence id.
    pub(crate) spans: crate::atomic_spans::AtomicSpans,
    /// Image spans and the per-step encoder budget (`encoder_budget`), by sequence id.
    pub(crate) encoder: crate::encoder_budget::EncoderBudget,
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
            tier: Box::new(crate::kv_connector::HostTierConnector::new(
                cfg.num_tier_blocks,
                cfg.block_size,
            )),
            // Rows belong to running sequences only, and those never exceed max_num_seqs
            // (children not yet forked included), so this size is final.
            tables: BlockTable::new(cfg.max_num_seqs, cfg.max_model_len.div_ceil(cfg.block_size)),
            watermark_blocks: cfg.watermark_blocks(cfg.num_blocks),
            cfg,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            spans: Default::default(),
            encoder: Default::default(),
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
    /// Prompt ranges `(start, end)` of `seq_id` that a prefill chunk must take whole (a
    /// bidirectional multimodal item): a chunk never ends strictly inside one.
    pub fn set_atomic_spans(&mut self, seq_id: i64, spans: Vec<(usize, usize)>) {
        self.spans.set(seq_id, spans);
    }

    /// The encoder rows a step may reach (vLLM's `max_num_encoder_input_tokens`); unlimited until set.
    pub fn set_encoder_budget(&mut self, max_num_encoder_input_tokens: usize) {
        self.encoder.set_limit(max_num_encoder_input_tokens);
    }

    /// Image spans `(start, end, image hash)` of `seq_id`, each charged to the encoder budget of the
    /// step whose chunk reaches it first, unless its output is cached or the step charged its hash.
    pub fn set_encoder_spans(&mut self, seq_id: i64, spans: Vec<(usize, usize, String)>) {
        self.encoder.set(seq_id, spans);
    }

    /// The runner's encoder cache changed since the last call: `added` image hashes are held now,
    /// `removed` ones are not (an image whose output is held costs no encoder budget).
    pub fn update_encoder_cache(&mut self, added: Vec<String>, removed: Vec<String>) {
        self.encoder.update_cached(added, removed);
    }

    /// Encoder rows the last scheduled step charged to its budget.
    pub fn encoder_rows_charged(&self) -> usize {
        self.encoder.charged()
    }

    /// `num_new` tokens from `nc` cut to the step's encoder budget, then off the atomic spans.
    pub(crate) fn cut_chunk(&self, seq_id: i64, nc: usize, num_new: usize) -> usize {
        self.spans
            .cut(seq_id, nc, self.encoder.cut(seq_id, nc, num_new))
    }

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
        self.spans.remove(seq.seq_id);
        self.encoder.remove(seq.seq_id);
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
}

#[cfg(test)]
mod tests;
