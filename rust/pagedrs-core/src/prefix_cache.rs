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

/// Cached blocks: hash -> block, and per block one record `[hash, parent hash, tokens]`.
///
/// Whether a block is cached is the pool's flag (kept in its block record); this type trusts the
/// caller on it. INVARIANT: block `b` is flagged cached iff `map[record(b).hash] == b`.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_size: usize,
    map: IdMap,
    /// Stride `HEADER + block_size` u32s per block: hash (2), parent hash (2), tokens.
    records: Vec<u32>,
}

const HEADER: usize = 4;

fn join(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            map: IdMap::default(),
            records: vec![0; num_blocks * (HEADER + block_size)],
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The cached blocks' hashes, in no particular order.
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.keys().copied()
    }

    fn record(&self, b: BlockId) -> &[u32] {
        let stride = HEADER + self.block_size;
        &self.records[b.idx() * stride..(b.idx() + 1) * stride]
    }

    fn record_mut(&mut self, b: BlockId) -> &mut [u32] {
        let stride = HEADER + self.block_size;
        &mut self.records[b.idx() * stride..(b.idx() + 1) * stride]
    }

    /// Hash recorded for block `b` (meaningful only while it is cached).
    pub fn hash_of(&self, b: BlockId) -> u64 {
        let r = self.record(b);
        join(r[0], r[1])
    }

    /// Tokens recorded for block `b` (meaningful only while it is cached).
    pub fn tokens_of(&self, b: BlockId) -> &[u32] {
        &self.record(b)[HEADER..]
    }

    /// The cached block for `hash`, only if its parent hash and tokens match exactly.
    pub fn lookup(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let b = BlockId(*self.map.get(&hash)?);
        let r = self.record(b);
        (join(r[2], r[3]) == parent && &r[HEADER..] == tokens).then_some(b)
    }

    /// Registers full block `b` (not cached). False, changing nothing, when another block
    /// already holds `hash`.
    pub fn insert(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        if !self.claim(b, hash) {
            return false;
        }
        self.write_record(b, hash, parent, tokens);
        true
    }

    /// The map half of `insert`: claims `hash` for `b` unless another block holds it.
    pub fn claim(&mut self, b: BlockId, hash: u64) -> bool {
        match self.map.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(b.0);
                true
            }
        }
    }

    /// The record half of `insert`, after a successful `claim`.
    pub fn write_record(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[u32]) {
        let r = self.record_mut(b);
        r[..HEADER].copy_from_slice(&[
            hash as u32,
            (hash >> 32) as u32,
            parent as u32,
            (parent >> 32) as u32,
        ]);
        r[HEADER..].copy_from_slice(tokens);
    }

    /// Forgets cached block `b` (it is about to be reused).
    pub fn remove(&mut self, b: BlockId) {
        let h = self.hash_of(b);
        let removed = self.map.remove(&h);
        debug_assert_eq!(removed, Some(b.0));
    }

    pub fn reserve(&mut self, n: usize) {
        self.map.reserve(n);
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Moves cached block `src`'s entry to `dst` (not cached).
    pub fn move_block(&mut self, src: BlockId, dst: BlockId) {
        let stride = HEADER + self.block_size;
        self.records.copy_within(
            src.idx() * stride..(src.idx() + 1) * stride,
            dst.idx() * stride,
        );
        self.map.insert(self.hash_of(dst), dst.0);
    }

    pub fn resize(&mut self, num_blocks: usize) {
        self.records
            .resize(num_blocks * (HEADER + self.block_size), 0);
    }

    /// Checks the map against the pool's cached flags.
    pub fn check(
        &self,
        is_cached: impl Fn(BlockId) -> bool,
        num_blocks: usize,
    ) -> Result<(), String> {
        for (&h, &b) in &self.map {
            let b = BlockId(b);
            if b.idx() >= num_blocks || !is_cached(b) || self.hash_of(b) != h {
                return Err(format!("cache map entry {h:#x} -> block {} is stale", b.0));
            }
        }
        let n = (0..num_blocks as u32)
            .filter(|&b| is_cached(BlockId(b)))
            .count();
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
        c.check(|b| b == BlockId(1), 4).unwrap();
        assert!(c.check(|_| false, 4).is_err());
        c.remove(BlockId(1));
        assert_eq!(c.lookup(h, r, &[7, 8]), None);
        c.check(|_| false, 4).unwrap();
    }

    #[test]
    fn move_block_keeps_the_entry() {
        let mut c = PrefixCache::new(4, 2);
        let r = root_hash(0);
        let h = block_hash(r, &[3, 4]);
        c.insert(BlockId(3), h, r, &[3, 4]);
        c.move_block(BlockId(3), BlockId(0));
        assert_eq!(c.lookup(h, r, &[3, 4]), Some(BlockId(0)));
        assert_eq!(c.tokens_of(BlockId(0)), &[3, 4]);
        c.resize(2);
        c.check(|b| b == BlockId(0), 2).unwrap();
        assert_eq!(c.len(), 1);
    }
}
