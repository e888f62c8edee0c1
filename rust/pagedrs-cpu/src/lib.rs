//! CPU kernels over the paged KV cache (pure Rust, no Python): the decode attention used by the torch
//! backend on CPU instead of its gather + batched matmul.
//!
//! KV cache layout (as everywhere in pagedrs): `[2, num_blocks, block_size, num_kv_heads, head_size]`,
//! index 0 = K, 1 = V.

mod decode;

pub use decode::{paged_decode_f32, DecodeDims};

/// Inconsistent arguments; every message names the numbers involved.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("{name} has {actual} elements, expected {expected}")]
    Length {
        name: &'static str,
        actual: usize,
        expected: usize,
    },
    #[error("num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")]
    Heads {
        num_heads: usize,
        num_kv_heads: usize,
    },
    #[error("{name} must be > 0")]
    Zero { name: &'static str },
    #[error("seq_lens[{seq}] = {len} is outside 0..={max} (block table width x block_size)")]
    SeqLen { seq: usize, len: i64, max: usize },
    #[error("block_tables[{seq}, {idx}] = {block} is outside 0..{num_blocks}")]
    Block {
        seq: usize,
        idx: usize,
        block: i64,
        num_blocks: usize,
    },
}
