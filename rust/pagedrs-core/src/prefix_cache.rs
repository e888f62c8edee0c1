//! Prefix caching: chained block hashes and the hash -> block map, with each cached block's own
//! tokens and parent hash kept so a hit is verified, not trusted.
//!
//! A block's hash chains over the prefix: `hash(parent_hash, block_tokens)`, where the first
//! block's parent is `root_hash(extra_key)` (the extra key carries e.g. the cache salt).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::BlockId;

const ROOT: u64 = 0x9e37_79b9_7f4a_7c15;
const MUL: u64 = 0xff51_afd7_ed55_8ccd;

fn mix(mut x: u64) -> u64 {
    // splitmix64 finalizer: full avalanche.
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Parent hash of a prompt's first block, derived from the extra key (0 = none).
pub fn root_hash(extra_key: u64) -> u64 {
    mix(ROOT ^ mix(extra_key))
}

/// Hash of one full block, chained on its parent's hash.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ (tokens.len() as u64).wrapping_mul(MUL);
    let mut chunks = tokens.chunks_exact(2);
    for c in &mut chunks {
        let v = u64::from(c[0]) | (u64::from(c[1]) << 32);
        h = (h ^ v).wrapping_mul(MUL).rotate_left(29);
    }
    if let [t] = chunks.remainder() {
        h = (h ^ u64::from(*t)).wrapping_mul(MUL).rotate_left(29);
    }
    mix(h)
}

/// Hash of an arbitrary string (the cache salt) into an extra key.
pub fn extra_key_of(salt: &str) -> u64 {
    let mut h = ROOT;
    for chunk in salt.as_bytes().chunks(8) {
        let mut buf = [0u8; 8];
        buf[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(buf)).wrapping_add(chunk.len() as u64);
    }
    mix(h) | 1 // never 0, which means "no extra key"
}

/// Keys are already hashes: pass them through.
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type IdMap = HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>;

/// Cached blocks: hash -> block, and per block its hash, parent hash and tokens.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_size: usize,
    map: IdMap,
    // INVARIANT: meta[b].cached iff map[meta[b].hash] == b.
    meta: Vec<Meta>,
    tokens: Vec<u32>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    hash: u64,
    parent: u64,
    cached: bool,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            map: IdMap::default(),
            meta: vec![Meta::default(); num_blocks],
            tokens: vec![0; num_blocks * block_size],
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.meta[b.idx()].cached
    }

    pub fn hash_of(&self, b: BlockId) -> Option<u64> {
        self.meta[b.idx()].cached.then(|| self.meta[b.idx()].hash)
    }

    pub fn tokens_of(&self, b: BlockId) -> &[u32] {
        let s = b.idx() * self.block_size;
        &self.tokens[s..s + self.block_size]
    }

    /// The cached block for `hash`, only if its parent hash and tokens match exactly.
    pub fn lookup(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let &b = self.map.get(&hash)?;
        let b = BlockId(b);
        (self.meta[b.idx()].parent == parent && self.tokens_of(b) == tokens).then_some(b)
    }

    /// Registers full block `b`. Returns false (and changes nothing) when `b` is already cached or
    /// another block already holds `hash`.
    pub fn insert(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.meta[b.idx()].cached || self.map.contains_key(&hash) {
            return false;
        }
        self.map.insert(hash, b.0);
        self.meta[b.idx()] = Meta { hash, parent, cached: true };
        let s = b.idx() * self.block_size;
        self.tokens[s..s + self.block_size].copy_from_slice(tokens);
        true
    }

    /// Forgets block `b` (it is about to be reused). Returns whether it was cached.
    pub fn evict(&mut self, b: BlockId) -> bool {
        if !self.meta[b.idx()].cached {
            return false;
        }
        self.meta[b.idx()].cached = false;
        self.map.remove(&self.meta[b.idx()].hash);
        true
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.meta.iter_mut().for_each(|m| m.cached = false);
    }

    /// Moves the cache entry of `src` (if any) to `dst`, which must not be cached.
    pub fn move_block(&mut self, src: BlockId, dst: BlockId) {
        debug_assert!(!self.meta[dst.idx()].cached);
        if !self.meta[src.idx()].cached {
            return;
        }
        let (s, d) = (src.idx(), dst.idx());
        self.meta[d] = self.meta[s];
        self.meta[s].cached = false;
        let bs = self.block_size;
        self.tokens.copy_within(s * bs..(s + 1) * bs, d * bs);
        self.map.insert(self.meta[d].hash, dst.0);
    }

    pub fn resize(&mut self, num_blocks: usize) {
        debug_assert!(self.meta.iter().skip(num_blocks).all(|m| !m.cached));
        self.meta.resize(num_blocks, Meta::default());
        self.tokens.resize(num_blocks * self.block_size, 0);
    }

    /// Checks the map against the per-block flags.
    pub fn check(&self) -> Result<(), String> {
        for (&h, &b) in &self.map {
            let i = b as usize;
            if i >= self.meta.len() || !self.meta[i].cached || self.meta[i].hash != h {
                return Err(format!("cache map entry {h:#x} -> block {b} is stale"));
            }
        }
        let n = self.meta.iter().filter(|m| m.cached).count();
        if n != self.map.len() {
            return Err(format!(
                "{n} blocks flagged cached but the map has {}",
                self.map.len()
            ));
        }
        Ok(())
    }
}

impl BlockId {
    pub(crate) fn idx(self) -> usize {
        self.0 as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_chains_and_differs() {
        let r = root_hash(0);
        let a = block_hash(r, &[1, 2, 3, 4]);
        assert_eq!(a, block_hash(r, &[1, 2, 3, 4]));
        assert_ne!(a, block_hash(r, &[1, 2, 3, 5]));
        assert_ne!(
            a,
            block_hash(root_hash(extra_key_of("salt")), &[1, 2, 3, 4])
        );
        assert_ne!(block_hash(a, &[1, 2, 3, 4]), a);
        assert_ne!(block_hash(r, &[0]), block_hash(r, &[0, 0]));
        assert_ne!(extra_key_of("a"), extra_key_of("b"));
        assert_ne!(extra_key_of(""), 0);
    }

    #[test]
    fn lookup_verifies_tokens_and_parent() {
        let mut c = PrefixCache::new(4, 2);
        let r = root_hash(0);
        let h = block_hash(r, &[7, 8]);
        assert!(c.insert(BlockId(1), h, r, &[7, 8]));
        assert_eq!(c.lookup(h, r, &[7, 8]), Some(BlockId(1)));
        // A forged hash (collision) never serves other tokens or another parent.
        assert_eq!(c.lookup(h, r, &[7, 9]), None);
        assert_eq!(c.lookup(h, r ^ 1, &[7, 8]), None);
        // Duplicates are refused.
        assert!(!c.insert(BlockId(2), h, r, &[7, 8]));
        assert!(!c.insert(BlockId(1), h ^ 1, r, &[7, 8]));
        c.check().unwrap();
        assert!(c.evict(BlockId(1)));
        assert!(!c.evict(BlockId(1)));
        assert_eq!(c.lookup(h, r, &[7, 8]), None);
        c.check().unwrap();
    }

    #[test]
    fn move_block_keeps_the_entry() {
        let mut c = PrefixCache::new(4, 2);
        let r = root_hash(0);
        let h = block_hash(r, &[3, 4]);
        c.insert(BlockId(3), h, r, &[3, 4]);
        c.move_block(BlockId(3), BlockId(0));
        assert_eq!(c.lookup(h, r, &[3, 4]), Some(BlockId(0)));
        assert!(!c.is_cached(BlockId(3)));
        c.resize(2);
        c.check().unwrap();
        assert_eq!(c.len(), 1);
    }
}
