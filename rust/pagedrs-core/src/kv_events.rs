//! Prefix-cache change events: which block hashes became cached, which were evicted, and when the
//! whole cache was cleared, in the order they happened. The engine drains them once per step for
//! a cache-aware router and for vLLM-style KV-event publishing (BlockStored / BlockRemoved /
//! AllBlocksCleared).
//!
//! Recording is off by default: the pool then holds no log and each cache change costs one branch.

use crate::prefix_cache::{block_hash, root_hash};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
