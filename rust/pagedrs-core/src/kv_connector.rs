//! The scheduler side of a KV connector, as vLLM's `KVConnectorBase_V1` splits it: the scheduler asks
//! what an external tier holds and tells it what the device pool cached; the worker side moves the
//! bytes from the transfer pairs the step plan carries. The host KV tier (`kv_tier`) is the first
//! implementation ([`HostTierConnector`]); a remote tier or a prefill/decode transfer is another
//! implementation of [`KvConnector`], with no change to the scheduler (`tier_admit` talks only to it).

use crate::kv_events::KvEvents;
use crate::kv_tier::{HostTier, TierCounters};

/// One external KV tier, seen from the scheduler. Slots are the tier's block addresses, as the
/// worker side knows them; blocks are keyed by the prefix cache's chained hashes and verified
/// against their parent hash and tokens, so a hit is exact.
pub trait KvConnector: std::fmt::Debug + Send {
    /// Blocks the tier can hold (0: no tier).
    fn num_slots(&self) -> usize;
    /// Blocks it holds.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn counters(&self) -> &TierCounters;
    /// The slot holding exactly this block (an admission's hit; the tier may mark it recently used).
    fn lookup(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32>;
    /// Whether the tier holds exactly this block (no side effect).
    fn holds(&self, hash: u64, parent: u64, tokens: &[u32]) -> bool;
    /// The device pool cached this block, its bytes in device block `src`: the tier's slot when it
    /// takes a copy (then a (src, slot) transfer is pending), None when it holds it or has no room.
    fn on_stored(
        &mut self,
        hash: u64,
        parent: u64,
        extra_key: u64,
        tokens: &[u32],
        src: i64,
    ) -> Option<u32>;
    /// An admission loads `queried` looked-up blocks, `loaded` of them from the tier.
    fn on_loaded(&mut self, queried: usize, loaded: usize);
    /// A block whose bytes come from outside (a tier behind this one) takes a slot: the slot, or
    /// None when the tier holds it or has no room; a pending transfer into that slot is void.
    fn insert_external(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32>;
    /// The device pool's prefix cache was reset: every entry and pending transfer goes.
    fn on_cleared(&mut self);
    /// The (hash, parent hash, tokens) a slot holds.
    fn record_of(&self, slot: u32) -> Option<(u64, u64, Vec<u32>)>;
    /// The pending (device block, slot) store transfers, for the next step plan.
    fn take_transfers(&mut self) -> Vec<i64>;
    fn set_kv_events(&mut self, on: bool);
    fn take_kv_events(&mut self) -> KvEvents;
    fn check(&self) -> Result<(), String>;
}

/// The host KV tier as a connector: its index and the store transfers the next plan carries.
#[derive(Debug, Clone)]
pub struct HostTierConnector {
    tier: HostTier,
    pending: Vec<i64>,
}

impl HostTierConnector {
    pub fn new(num_slots: usize, block_size: usize) -> Self {
        Self {
            tier: HostTier::new(num_slots, block_size),
            pending: Vec::new(),
        }
    }

    /// One store per slot in a plan: an earlier one to a slot reused since is void.
    fn void_pending(&mut self, s: u32) {
        let slot = i64::from(s);
        if self.pending.chunks_exact(2).any(|m| m[1] == slot) {
            let old = std::mem::take(&mut self.pending);
            self.pending
                .extend(old.chunks_exact(2).filter(|m| m[1] != slot).flatten());
        }
    }
}

impl KvConnector for HostTierConnector {
    fn num_slots(&self) -> usize {
        self.tier.num_slots()
    }

    fn len(&self) -> usize {
        self.tier.len()
    }

    fn counters(&self) -> &TierCounters {
        &self.tier.counters
    }

    fn lookup(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        self.tier.lookup(hash, parent, tokens)
    }

    fn holds(&self, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        self.tier.holds(hash, parent, tokens)
    }

    fn on_stored(
        &mut self,
        hash: u64,
        parent: u64,
        extra_key: u64,
        tokens: &[u32],
        src: i64,
    ) -> Option<u32> {
        let s = self.tier.store_keyed(hash, parent, extra_key, tokens)?;
        self.void_pending(s);
        self.pending.extend([src, i64::from(s)]);
        Some(s)
    }

    fn on_loaded(&mut self, queried: usize, loaded: usize) {
        let c = &mut self.tier.counters;
        c.queried_blocks += queried as u64;
        c.hit_blocks += loaded as u64;
        c.loaded_blocks += loaded as u64;
    }

    fn insert_external(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        let s = self.tier.insert(hash, parent, tokens)?;
        self.void_pending(s);
        Some(s)
    }

    fn on_cleared(&mut self) {
        self.tier.clear();
        self.pending.clear();
    }

    fn record_of(&self, slot: u32) -> Option<(u64, u64, Vec<u32>)> {
        self.tier.record_of(slot)
    }

    fn take_transfers(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.pending)
    }

    fn set_kv_events(&mut self, on: bool) {
        self.tier.set_kv_events(on);
    }

    fn take_kv_events(&mut self) -> KvEvents {
        self.tier.take_kv_events()
    }

    fn check(&self) -> Result<(), String> {
        self.tier.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_become_transfers_and_a_reused_slot_voids_its_store() {
        let mut c: Box<dyn KvConnector> = Box::new(HostTierConnector::new(1, 2));
        assert_eq!(c.on_stored(10, 1, 0, &[1, 2], 5), Some(0));
        assert_eq!(c.on_stored(10, 1, 0, &[1, 2], 6), None); // held
        assert!(c.holds(10, 1, &[1, 2]) && c.lookup(10, 1, &[1, 2]) == Some(0));
        // The only slot is reused for a block read from outside: the pending store is void.
        assert_eq!(c.insert_external(20, 10, &[3, 4]), Some(0));
        assert!(c.take_transfers().is_empty());
        assert_eq!(c.on_stored(30, 20, 0, &[5, 6], 7), Some(0));
        assert_eq!(c.take_transfers(), vec![7, 0]);
        assert!(c.take_transfers().is_empty());
        c.on_loaded(3, 1);
        let n = c.counters();
        assert_eq!((n.queried_blocks, n.hit_blocks, n.stored_blocks), (3, 1, 2));
        c.on_stored(40, 30, 0, &[7, 8], 8);
        c.on_cleared();
        assert!(c.is_empty() && c.take_transfers().is_empty() && c.record_of(0).is_none());
        c.check().unwrap();
    }
}
