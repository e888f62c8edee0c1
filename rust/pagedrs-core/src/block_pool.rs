//! The device block pool: ref counts, the free queue (LRU eviction of cached blocks) and the
//! prefix cache.

use crate::free_queue::FreeQueue;
use crate::kv_events::KvEvents;
use crate::prefix_cache::PrefixCache;
use crate::BlockId;

/// A full block to cache, with where its tokens are (`slot`, block index `idx`).
#[derive(Debug, Clone, Copy)]
pub struct CacheItem {
    pub block: BlockId,
    pub hash: u64,
    pub parent: u64,
    /// The sequence's extra key (cache salt), for the stored-block event.
    pub extra_key: u64,
    pub slot: u32,
    pub idx: u32,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    // INVARIANT: a block is in the free queue iff its ref count is 0.
    // Ref counts and cached flags live in the free queue's per-block records.
    free: FreeQueue,
    cache: PrefixCache,
    /// Cached blocks evicted to make room (cumulative).
    pub num_evictions: u64,
    /// Prefix-cache events since the engine last drained them; None: not recorded (`kv_events`).
    pub(crate) events: Option<Box<KvEvents>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            free: FreeQueue::new(num_blocks),
            cache: PrefixCache::new(num_blocks, block_size),
            num_evictions: 0,
            events: None,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.free.capacity()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Free blocks, cached ones (still reusable as hits) included.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            0.0
        } else {
            self.num_used() as f64 / self.num_blocks() as f64
        }
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.free.node(b).ref_cnt
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.free.node(b).cached
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    pub fn free_queue(&self) -> &FreeQueue {
        &self.free
    }

    /// Takes the least recently used free block (evicting its cache entry). None when empty.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop_front()?;
        let node = self.free.node_mut(b);
        node.ref_cnt = 1;
        if node.cached {
            node.cached = false;
            if let Some(ev) = self.events.as_deref_mut() {
                ev.removed(self.cache.hash_of(b));
            }
            self.cache.remove(b);
            self.num_evictions += 1;
        }
        Some(b)
    }

    /// Adds a reference to `b` (a prefix-cache hit or a fork), taking it off the free queue.
    pub fn incref(&mut self, b: BlockId) {
        let node = self.free.node_mut(b);
        node.ref_cnt += 1;
        if node.ref_cnt == 1 {
            self.free.remove(b);
        }
    }

    /// Drops one reference. A block reaching 0 is queued: cached blocks at the back (they survive
    /// longest), others at the front (reused first).
    pub fn free(&mut self, b: BlockId) {
        let node = self.free.node_mut(b);
        debug_assert!(node.ref_cnt > 0, "double free of block {}", b.0);
        node.ref_cnt -= 1;
        if node.ref_cnt == 0 {
            if node.cached {
                self.free.push_back(b);
            } else {
                self.free.push_front(b);
            }
        }
    }

    /// Frees a block table tail first, so a prefix's later blocks are evicted before its head.
    pub fn free_table(&mut self, table: &[u32]) {
        for &b in table.iter().rev() {
            self.free(BlockId(b));
        }
    }

    /// Looks a full block up in the prefix cache (verified against tokens and parent hash).
    pub fn lookup(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        self.cache.lookup(hash, parent, tokens)
    }

    /// Caches full, in-use block `b`. False if it or its hash is already cached.
    pub fn cache_block(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        let node = self.free.node_mut(b);
        debug_assert!(node.ref_cnt > 0);
        if node.cached || !self.cache.insert(b, hash, parent, tokens) {
            return false;
        }
        if let Some(ev) = self.events.as_deref_mut() {
            ev.stored(hash, parent, 0, tokens); // no extra key here: `cache_blocks` carries it
        }
        self.free.node_mut(b).cached = true;
        true
    }

    /// Caches many full, in-use blocks at once; `tokens(i)` gives item `i`'s tokens. Each phase
    /// is one loop of independent random accesses, so their cache misses overlap. Returns how
    /// many were newly cached.
    pub fn cache_blocks<'t>(
        &mut self,
        items: &mut Vec<CacheItem>,
        tokens: impl Fn(&CacheItem) -> &'t [u32],
    ) -> usize {
        items.retain(|it| !self.free.node(it.block).cached);
        self.cache.reserve(items.len());
        items.retain(|it| self.cache.claim(it.block, it.hash));
        for it in items.iter() {
            let toks = tokens(it);
            self.cache.write_record(it.block, it.hash, it.parent, toks);
            if let Some(ev) = self.events.as_deref_mut() {
                ev.stored(it.hash, it.parent, it.extra_key, toks);
            }
            self.free.node_mut(it.block).cached = true;
        }
        items.len()
    }

    /// Drops every cache entry. Only when no block is in use; returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_used() > 0 {
            return false;
        }
        self.cache.clear();
        if let Some(ev) = self.events.as_deref_mut() {
            ev.cleared();
        }
        for b in 0..self.num_blocks() {
            self.free.node_mut(BlockId(b as u32)).cached = false;
        }
        true
    }

    /// Adds blocks `num_blocks()..n`, reused before any cached block.
    pub fn grow(&mut self, n: usize) {
        let old = self.num_blocks();
        debug_assert!(n >= old);
        self.free.grow(n);
        self.cache.resize(n);
        for b in (old..n).rev() {
            self.free.push_front(BlockId(b as u32));
        }
    }

    /// Shrinks to `n` blocks. Returns the moves `(src, dst)` of in-use blocks from `n..` into free
    /// blocks below `n`; the caller rewrites block tables. `None` when more than `n` are in use.
    pub fn shrink(&mut self, n: usize) -> Option<Vec<(BlockId, BlockId)>> {
        let old = self.num_blocks();
        debug_assert!(n <= old);
        if self.num_used() > n {
            return None;
        }
        for b in n..old {
            let b = BlockId(b as u32);
            if self.ref_count(b) == 0 {
                self.free.remove(b);
                self.uncache(b);
            }
        }
        let mut moves = Vec::new();
        for b in n..old {
            let src = BlockId(b as u32);
            let r = self.ref_count(src);
            if r == 0 {
                continue;
            }
            let dst = self
                .free
                .pop_front()
                .expect("enough free blocks below the new size");
            self.uncache(dst);
            if self.is_cached(src) {
                self.cache.move_block(src, dst);
                self.free.node_mut(src).cached = false;
                self.free.node_mut(dst).cached = true;
            }
            self.free.node_mut(dst).ref_cnt = r;
            self.free.node_mut(src).ref_cnt = 0;
            moves.push((src, dst));
        }
        self.free.truncate(n);
        self.cache.resize(n);
        Some(moves)
    }

    fn uncache(&mut self, b: BlockId) {
        if self.is_cached(b) {
            if let Some(ev) = self.events.as_deref_mut() {
                ev.removed(self.cache.hash_of(b));
            }
            self.cache.remove(b);
            self.free.node_mut(b).cached = false;
        }
    }

    /// Checks the free queue against the ref counts and the cache map.
    pub fn check(&self) -> Result<(), String> {
        let n = self.num_blocks();
        let mut seen = vec![false; n];
        let mut count = 0;
        for b in self.free.iter() {
            if b.idx() >= n {
                return Err(format!("free queue holds block {} >= pool size {n}", b.0));
            }
            if seen[b.idx()] {
                return Err(format!("block {} is twice in the free queue", b.0));
            }
            seen[b.idx()] = true;
            count += 1;
            if self.ref_count(b) != 0 {
                return Err(format!(
                    "block {} is free and referenced ({} refs)",
                    b.0,
                    self.ref_count(b)
                ));
            }
        }
        if count != self.free.len() {
            return Err(format!(
                "free queue length {} but {count} linked",
                self.free.len()
            ));
        }
        for (b, &free) in seen.iter().enumerate() {
            if self.ref_count(BlockId(b as u32)) == 0 && !free {
                return Err(format!(
                    "block {b} has no refs but is not in the free queue"
                ));
            }
        }
        if self.num_free() + self.num_used() != n {
            return Err(format!(
                "free {} + used {} != pool {n}",
                self.num_free(),
                self.num_used()
            ));
        }
        self.cache.check(|b| self.is_cached(b), n)
    }
}

impl BlockPool {
    /// Starts (an empty log) or stops recording prefix-cache events.
    pub fn set_kv_events(&mut self, on: bool) {
        if !on {
            self.events = None;
        } else if self.events.is_none() {
            self.events = Some(Box::new(KvEvents::new(self.block_size())));
        }
    }

    pub fn kv_events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// The events recorded since the last call (none when recording is off).
    pub fn take_kv_events(&mut self) -> KvEvents {
        match self.events.as_deref_mut() {
            Some(ev) => ev.take(),
            None => KvEvents::new(self.block_size()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_cache::{block_hash, root_hash};

    #[test]
    fn allocate_and_free() {
        let mut p = BlockPool::new(3, 4);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_eq!((a, b), (BlockId(0), BlockId(1)));
        assert_eq!(p.num_free(), 1);
        p.incref(a);
        p.free(a);
        assert_eq!(p.ref_count(a), 1);
        p.free_table(&[a.0, b.0]);
        assert_eq!(p.num_free(), 3);
        // Uncached blocks go to the front: reused first.
        assert_eq!(p.allocate(), Some(a));
        p.check().unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_lru() {
        let mut p = BlockPool::new(3, 2);
        let r = root_hash(0);
        let blocks: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        let h0 = block_hash(r, &[1, 2]);
        let h1 = block_hash(h0, &[3, 4]);
        assert!(p.cache_block(blocks[0], h0, r, &[1, 2]));
        assert!(p.cache_block(blocks[1], h1, h0, &[3, 4]));
        p.free_table(&[blocks[0].0, blocks[1].0]);
        p.free(blocks[2]);
        // Uncached block 2 is reused first, then the tail block 1, then the head block 0.
        assert_eq!(
            p.free_queue().iter().map(|b| b.0).collect::<Vec<_>>(),
            vec![2, 1, 0]
        );
        assert_eq!(p.lookup(h0, r, &[1, 2]), Some(blocks[0]));
        p.incref(blocks[0]); // a hit takes it off the queue
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.allocate(), Some(BlockId(2)));
        assert_eq!(p.allocate(), Some(BlockId(1)));
        assert_eq!(p.num_evictions, 1);
        assert_eq!(p.lookup(h1, h0, &[3, 4]), None);
        p.check().unwrap();
    }

    #[test]
    fn reset_only_when_idle() {
        let mut p = BlockPool::new(2, 1);
        let a = p.allocate().unwrap();
        assert!(p.cache_block(a, 5, 6, &[1]));
        assert!(!p.reset_prefix_cache());
        p.free(a);
        assert!(p.reset_prefix_cache());
        assert!(p.cache().is_empty());
    }

    #[test]
    fn grow_then_shrink_moves_used_blocks() {
        let mut p = BlockPool::new(2, 1);
        p.grow(4);
        assert_eq!(p.num_free(), 4);
        // New blocks are reused before the old ones.
        let got: Vec<_> = (0..4).map(|_| p.allocate().unwrap().0).collect();
        assert_eq!(got, vec![2, 3, 0, 1]);
        p.free(BlockId(0));
        p.free(BlockId(1));
        assert!(p.cache_block(BlockId(3), 9, 1, &[5]));
        let moves = p.shrink(2).unwrap();
        assert_eq!(moves.len(), 2);
        assert_eq!(p.num_blocks(), 2);
        assert_eq!(p.num_free(), 0);
        let dst3 = moves.iter().find(|m| m.0 == BlockId(3)).unwrap().1;
        assert_eq!(p.lookup(9, 1, &[5]), Some(dst3));
        p.check().unwrap();
        assert!(p.shrink(1).is_none());
    }
}
