//! Prefix-cache change events: which block hashes became cached, which were evicted or dropped,
//! and when the whole cache was cleared, in the order they happened. The engine drains them once
//! per step, for a cache-aware router (the net change, [`KvEvents::net`]) and for vLLM-style
//! KV-event publishing (BlockStored / BlockRemoved / AllBlocksCleared, in order).
//!
//! Recording is off by default: the pool then holds no log and a cache change costs one branch.

use std::collections::HashMap;

use crate::prefix_cache::{block_hash, root_hash, IdentityHasher};

/// The chained hashes of the full blocks of `tokens`, exactly as the scheduler computes them
/// (`block_hash(parent, block)`, the first block's parent `root_hash(extra_key)`).
pub fn prefix_block_hashes(tokens: &[u32], block_size: usize, extra_key: u64) -> Vec<u64> {
    let mut parent = root_hash(extra_key);
    tokens
        .chunks_exact(block_size.max(1))
        .map(|blk| {
            parent = block_hash(parent, blk);
            parent
        })
        .collect()
}

/// What happened to the prefix cache, one entry per event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum KvEventKind {
    /// A full block became cached: its hash, parent hash, extra key and tokens are recorded.
    Stored = 0,
    /// A cached block was evicted (reused) or dropped (pool shrink): its hash is recorded.
    Removed = 1,
    /// Every cache entry was dropped (prefix-cache reset).
    Cleared = 2,
}

/// Prefix-cache events in the order they happened, column-wise. Entry `i` has `kinds[i]`,
/// `hashes[i]`, and (Stored only, else 0) `parents[i]`, `extra_keys[i]`; the tokens of the k-th
/// Stored entry are `tokens[k * block_size..(k + 1) * block_size]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvEvents {
    pub block_size: usize,
    pub kinds: Vec<KvEventKind>,
    pub hashes: Vec<u64>,
    pub parents: Vec<u64>,
    pub extra_keys: Vec<u64>,
    pub tokens: Vec<u32>,
}

/// One step's net change: applied to the set before it (clear if `cleared`, then remove
/// `removed`, then add `stored`) it gives the set after it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetChange {
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
    pub cleared: bool,
}

type HashState = HashMap<u64, (bool, bool), std::hash::BuildHasherDefault<IdentityHasher>>;

impl KvEvents {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    pub fn stored(&mut self, hash: u64, parent: u64, extra_key: u64, tokens: &[u32]) {
        debug_assert_eq!(tokens.len(), self.block_size);
        self.push(KvEventKind::Stored, hash, parent, extra_key);
        self.tokens.extend_from_slice(tokens);
    }

    pub fn removed(&mut self, hash: u64) {
        self.push(KvEventKind::Removed, hash, 0, 0);
    }

    pub fn cleared(&mut self) {
        self.push(KvEventKind::Cleared, 0, 0, 0);
    }

    fn push(&mut self, kind: KvEventKind, hash: u64, parent: u64, extra_key: u64) {
        self.kinds.push(kind);
        self.hashes.push(hash);
        self.parents.push(parent);
        self.extra_keys.push(extra_key);
    }

    /// Takes the recorded events, leaving this log empty (same block size).
    pub fn take(&mut self) -> KvEvents {
        let empty = KvEvents::new(self.block_size);
        std::mem::replace(self, empty)
    }

    /// Replays the events onto `set` (a consumer's view of the cache).
    pub fn apply(&self, set: &mut std::collections::HashSet<u64>) {
        for (&k, &h) in self.kinds.iter().zip(&self.hashes) {
            match k {
                KvEventKind::Stored => set.insert(h),
                KvEventKind::Removed => set.remove(&h),
                KvEventKind::Cleared => {
                    set.clear();
                    true
                }
            };
        }
    }

    /// The net change of these events (see [`NetChange`]): a hash removed and stored again is
    /// neither; after a clear, `stored` is everything cached since it.
    pub fn net(&self) -> NetChange {
        let start = self.kinds.iter().rposition(|&k| k == KvEventKind::Cleared);
        let cleared = start.is_some();
        let from = start.map_or(0, |i| i + 1);
        // hash -> (cached before these events, cached after); first touch decides "before".
        let mut state = HashState::default();
        let mut order = Vec::new();
        for (&k, &h) in self.kinds[from..].iter().zip(&self.hashes[from..]) {
            let now = k == KvEventKind::Stored;
            state.entry(h).and_modify(|s| s.1 = now).or_insert_with(|| {
                order.push(h);
                (!now && !cleared, now)
            });
        }
        let mut net = NetChange {
            cleared,
            ..NetChange::default()
        };
        for h in order {
            match state[&h] {
                (false, true) => net.stored.push(h),
                (true, false) => net.removed.push(h),
                _ => {}
            }
        }
        net
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn hashes_chain_over_full_blocks_only() {
        let toks = [1, 2, 3, 4, 5];
        let h = prefix_block_hashes(&toks, 2, 0);
        let r = root_hash(0);
        let h0 = block_hash(r, &[1, 2]);
        assert_eq!(h, vec![h0, block_hash(h0, &[3, 4])]);
        assert_ne!(prefix_block_hashes(&toks, 2, 7), h);
        assert!(prefix_block_hashes(&[1], 2, 0).is_empty());
    }

    fn net_applied(before: &HashSet<u64>, n: &NetChange) -> HashSet<u64> {
        let mut s = if n.cleared {
            HashSet::new()
        } else {
            before.clone()
        };
        for h in &n.removed {
            assert!(s.remove(h), "net removes {h}, which was not cached");
        }
        for &h in &n.stored {
            assert!(s.insert(h), "net stores {h}, which was cached");
        }
        s
    }

    #[test]
    fn net_change_equals_the_replay() {
        let before: HashSet<u64> = [1, 2, 3].into();
        let mut e = KvEvents::new(1);
        e.removed(1);
        e.stored(4, 0, 0, &[9]);
        e.removed(4);
        e.removed(2);
        e.stored(2, 0, 0, &[9]);
        e.stored(5, 0, 0, &[9]);
        let mut after = before.clone();
        e.apply(&mut after);
        let n = e.net();
        assert_eq!((n.stored.clone(), n.removed.clone()), (vec![5], vec![1]));
        assert_eq!(net_applied(&before, &n), after);
        e.cleared();
        e.stored(7, 0, 0, &[9]);
        e.stored(5, 0, 0, &[9]);
        e.removed(5);
        e.stored(8, 0, 0, &[9]);
        let mut after = before.clone();
        e.apply(&mut after);
        let n = e.net();
        assert!(n.cleared && n.removed.is_empty());
        assert_eq!(n.stored, vec![7, 8]);
        assert_eq!(net_applied(&before, &n), after);
        let taken = e.take();
        assert_eq!(taken.len(), 11);
        assert_eq!(taken.tokens.len(), 6);
        assert!(e.is_empty() && e.block_size == 1);
    }
}
