//! The scheduler side of an external KV tier (as vLLM's KV connector's scheduler half): an index of
//! the full blocks a second pool outside the device holds (host memory), keyed by the prefix cache's
//! chained block hashes, with least-recently-used eviction over a fixed number of slots.
//!
//! Each slot keeps the block's full record (hash, parent hash, tokens), so a lookup is exact: a hit
//! can never serve another prompt's KV. The bytes live with the runner (one host tensor per rank);
//! the scheduler only hands it `(device block, slot)` store pairs and `(slot, device block)` load
//! pairs through the step plan.
//!
//! With events on ([`HostTier::set_kv_events`]) the tier logs the blocks entering it (Stored) and
//! leaving it (Removed: least-recently-used eviction, and every held block when it is cleared), as
//! the device pool logs its prefix cache; the engine publishes them with medium "CPU", as vLLM's
//! CPU offloading tier does.

use crate::kv_events::KvEvents;
use crate::prefix_cache::IdentityHasher;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

type IdMap = HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>;

/// Record header: hash (2 u32), parent hash (2 u32), then the block's tokens.
const HEADER: usize = 4;
const NIL: u32 = u32::MAX;

/// Cumulative counters of one tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Blocks looked up after the device pool's prefix hit ended, and blocks found.
    pub queried_blocks: u64,
    pub hit_blocks: u64,
    /// Blocks copied into the tier and out of it (into device blocks).
    pub stored_blocks: u64,
    pub loaded_blocks: u64,
    /// Entries dropped to make room.
    pub evicted_blocks: u64,
}

/// The index of a tier of `num_slots` blocks.
#[derive(Debug, Clone)]
pub struct HostTier {
    block_size: usize,
    map: IdMap,
    records: Vec<u32>,
    // LRU list over occupied slots: head = least recently used. INVARIANT: a slot is in the list
    // iff its hash is in `map`; otherwise it is on `free`.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: Vec<u32>,
    pub counters: TierCounters,
    /// Blocks entering and leaving the tier since the engine last drained them; None: not recorded.
    events: Option<Box<KvEvents>>,
}

fn join(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

impl HostTier {
    pub fn new(num_slots: usize, block_size: usize) -> Self {
        Self {
            block_size,
            map: IdMap::default(),
            records: vec![0; num_slots * (HEADER + block_size)],
            prev: vec![NIL; num_slots],
            next: vec![NIL; num_slots],
            head: NIL,
            tail: NIL,
            free: (0..num_slots as u32).rev().collect(),
            counters: TierCounters::default(),
            events: None,
        }
    }

    /// Turns the tier's event log on (empty) or off.
    pub fn set_kv_events(&mut self, on: bool) {
        self.events = on.then(|| Box::new(KvEvents::new(self.block_size)));
    }

    /// The tier's events since the last call (empty when not recorded).
    pub fn take_kv_events(&mut self) -> KvEvents {
        self.events
            .as_deref_mut()
            .map_or_else(|| KvEvents::new(self.block_size), KvEvents::take)
    }

    pub fn num_slots(&self) -> usize {
        self.prev.len()
    }

    /// Slots holding a block.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn record(&self, s: u32) -> &[u32] {
        let stride = HEADER + self.block_size;
        &self.records[s as usize * stride..(s as usize + 1) * stride]
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[s as usize] = NIL;
        self.next[s as usize] = NIL;
    }

    fn push_back(&mut self, s: u32) {
        self.prev[s as usize] = self.tail;
        self.next[s as usize] = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
    }

    /// Marks `s` most recently used.
    fn touch(&mut self, s: u32) {
        self.unlink(s);
        self.push_back(s);
    }

    /// The slot holding `hash`, only if its parent hash and tokens match exactly; a hit becomes the
    /// most recently used entry.
    pub fn lookup(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        let &s = self.map.get(&hash)?;
        let r = self.record(s);
        let exact = join(r[2], r[3]) == parent && &r[HEADER..] == tokens;
        if exact {
            self.touch(s);
        }
        exact.then_some(s)
    }

    /// A slot for a new full block, or None when `hash` is already held (then marked recently used).
    /// When every slot is taken, the least recently used entry is dropped for it.
    pub fn store(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        self.store_keyed(hash, parent, 0, tokens)
    }

    /// As `store`, its Stored event carrying the block's chain `extra_key` (its LoRA / salt key).
    pub fn store_keyed(
        &mut self,
        hash: u64,
        parent: u64,
        extra_key: u64,
        tokens: &[u32],
    ) -> Option<u32> {
        let s = self.insert_keyed(hash, parent, extra_key, tokens)?;
        self.counters.stored_blocks += 1;
        Some(s)
    }

    /// As `store`, for a block whose bytes come from outside the device pool (a disk tier behind
    /// this one): not counted as stored. Its Stored event has extra key 0 (the key is not known).
    pub fn insert(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        self.insert_keyed(hash, parent, 0, tokens)
    }

    fn insert_keyed(
        &mut self,
        hash: u64,
        parent: u64,
        extra_key: u64,
        tokens: &[u32],
    ) -> Option<u32> {
        debug_assert_eq!(tokens.len(), self.block_size);
        if let Some(&s) = self.map.get(&hash) {
            self.touch(s);
            return None;
        }
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                let victim = self.head;
                if victim == NIL {
                    return None; // no slots at all
                }
                self.unlink(victim);
                let old = join(self.record(victim)[0], self.record(victim)[1]);
                self.map.remove(&old);
                self.counters.evicted_blocks += 1;
                if let Some(ev) = self.events.as_deref_mut() {
                    ev.removed(old);
                }
                victim
            }
        };
        let stride = HEADER + self.block_size;
        let r = &mut self.records[s as usize * stride..(s as usize + 1) * stride];
        r[..HEADER].copy_from_slice(&[
            hash as u32,
            (hash >> 32) as u32,
            parent as u32,
            (parent >> 32) as u32,
        ]);
        r[HEADER..].copy_from_slice(tokens);
        self.map.insert(hash, s);
        self.push_back(s);
        if let Some(ev) = self.events.as_deref_mut() {
            ev.stored(hash, parent, extra_key, tokens);
        }
        Some(s)
    }

    /// Whether the tier holds exactly this block (no change to the eviction order).
    pub fn holds(&self, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        self.map.get(&hash).is_some_and(|&s| {
            let r = self.record(s);
            join(r[2], r[3]) == parent && &r[HEADER..] == tokens
        })
    }

    /// The record (hash, parent hash, tokens) of an occupied slot.
    pub fn record_of(&self, s: u32) -> Option<(u64, u64, Vec<u32>)> {
        if s as usize >= self.num_slots() {
            return None;
        }
        let r = self.record(s);
        let hash = join(r[0], r[1]);
        (self.map.get(&hash) == Some(&s)).then(|| (hash, join(r[2], r[3]), r[HEADER..].to_vec()))
    }

    /// Slots from least to most recently used.
    pub fn lru_order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        let mut s = self.head;
        while s != NIL {
            out.push(s);
            s = self.next[s as usize];
        }
        out
    }

    /// Drops every entry (the device pool's prefix cache was reset: cached KV may be stale).
    pub fn clear(&mut self) {
        if self.events.is_some() {
            let held: Vec<u64> = self
                .lru_order()
                .iter()
                .map(|&s| join(self.record(s)[0], self.record(s)[1]))
                .collect();
            let ev = self.events.as_deref_mut().expect("checked");
            held.into_iter().for_each(|h| ev.removed(h));
        }
        self.map.clear();
        self.prev.fill(NIL);
        self.next.fill(NIL);
        (self.head, self.tail) = (NIL, NIL);
        self.free = (0..self.num_slots() as u32).rev().collect();
    }

    pub fn check(&self) -> Result<(), String> {
        let order = self.lru_order();
        if order.len() != self.map.len() || order.len() + self.free.len() != self.num_slots() {
            return Err(format!(
                "tier: {} listed, {} indexed, {} free of {} slots",
                order.len(),
                self.map.len(),
                self.free.len(),
                self.num_slots()
            ));
        }
        for &s in &order {
            let r = self.record(s);
            if self.map.get(&join(r[0], r[1])) != Some(&s) {
                return Err(format!("tier slot {s} is listed but not indexed"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_is_exact_and_eviction_is_least_recently_used() {
        let mut t = HostTier::new(2, 2);
        let a = t.store(10, 1, &[1, 2]).unwrap();
        let b = t.store(20, 10, &[3, 4]).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.store(10, 1, &[1, 2]), None); // held: touched, not stored again
        assert_eq!(t.lookup(20, 10, &[3, 4]), Some(b));
        assert_eq!(t.lookup(20, 10, &[3, 5]), None); // same hash, other tokens: never a hit
        assert_eq!(t.lookup(20, 11, &[3, 4]), None);
        assert_eq!(t.lru_order(), vec![a, b]);
        // Full: the least recently used entry (10) makes room.
        let c = t.store(30, 20, &[5, 6]).unwrap();
        assert_eq!(c, a);
        assert_eq!(t.lookup(10, 1, &[1, 2]), None);
        assert_eq!(t.lookup(30, 20, &[5, 6]), Some(a));
        assert_eq!(t.counters.evicted_blocks, 1);
        assert_eq!(t.counters.stored_blocks, 3);
        assert_eq!(t.len(), 2);
        assert!(t.holds(30, 20, &[5, 6]) && !t.holds(30, 20, &[5, 7]));
        assert_eq!(t.record_of(a), Some((30, 20, vec![5, 6])));
        // An inserted block (read from a disk tier) takes the LRU slot but is not counted stored.
        assert_eq!(t.insert(40, 30, &[7, 8]), Some(b));
        assert_eq!(t.counters.stored_blocks, 3);
        assert_eq!(t.record_of(b), Some((40, 30, vec![7, 8])));
        t.check().unwrap();
        t.clear();
        assert_eq!(t.record_of(a), None);
        assert!(t.is_empty());
        t.check().unwrap();
    }

    #[test]
    fn events_log_blocks_entering_and_leaving() {
        use crate::kv_events::KvEventKind::{Removed, Stored};
        let mut t = HostTier::new(2, 2);
        t.store(10, 1, &[1, 2]); // not recorded
        t.set_kv_events(true);
        t.store_keyed(20, 10, 7, &[3, 4]);
        assert_eq!(t.store(20, 10, &[3, 4]), None); // held: no event
        t.insert(30, 20, &[5, 6]); // evicts 10
        let e = t.take_kv_events();
        assert_eq!(e.kinds, vec![Stored, Removed, Stored]);
        assert_eq!(e.hashes, vec![20, 10, 30]);
        assert_eq!((e.parents[0], e.extra_keys[0]), (10, 7));
        assert_eq!(e.tokens, vec![3, 4, 5, 6]);
        assert!(t.take_kv_events().is_empty());
        t.clear();
        let e = t.take_kv_events();
        assert_eq!((e.kinds, e.hashes), (vec![Removed, Removed], vec![20, 30]));
        t.set_kv_events(false);
        t.store(40, 1, &[1, 1]);
        assert!(t.take_kv_events().is_empty());
    }

    #[test]
    fn a_tier_without_slots_stores_nothing() {
        let mut t = HostTier::new(0, 4);
        assert_eq!(t.store(1, 2, &[0; 4]), None);
        assert_eq!(t.lookup(1, 2, &[0; 4]), None);
        t.check().unwrap();
    }
}
