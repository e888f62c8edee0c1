#line 1 "cuda/cache_kernels.cu"
// KV cache writes and block copies.
//
// Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size]; index 0 = K,
// 1 = V. One slot's K (or V) row, num_kv_heads * head_size elements, is contiguous, and slot
// s = block * block_size + offset starts at s * row in either half, so neither kernel needs the
// block size.
//
// Both kernels move raw words W (uint4, uint2, unsigned int or unsigned short): the Python
// wrapper picks the widest word that divides every row size, stride and base address, so fp16,
// bf16 and fp32 caches share the same instantiations and every access is one aligned vector.
// Header-free on purpose: NVRTC needs no CUDA include directory to compile this file.

namespace pagedrs {

// Writes each token's K and V rows into slot slot_mapping[t] of the caches.
// grid: (num_tokens), block: (min(row_words, 256) rounded up to a warp)
// key, value: [num_tokens, num_kv_heads, head_size], inner two dims contiguous; the token stride
// (in words) may exceed row_words (a view into a fused qkv projection).
// A negative slot means "do not write" (padding tokens of a CUDA-graph batch).
template <typename W>
__global__ void __launch_bounds__(256) reshape_and_cache(
    const W* __restrict__ key, const W* __restrict__ value,
    W* __restrict__ key_cache, W* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,
    long long key_stride, long long value_stride, int row_words)
{
    const long long t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    const W* ksrc = key + t * key_stride;
    const W* vsrc = value + t * value_stride;
    W* kdst = key_cache + slot * row_words;
    W* vdst = value_cache + slot * row_words;
    for (int i = threadIdx.x; i < row_words; i += blockDim.x) {
        kdst[i] = ksrc[i];
        vdst[i] = vsrc[i];
    }
}

// Copies whole blocks, K and V, in every layer at once: pair p = (src, dst) = pairs[2p], pairs[2p+1].
// grid: (num_pairs, num_layers), block: (256)
// cache_ptrs[l] is the address of layer l's cache tensor [2, num_blocks, block_size, ...];
// block_words = block_size * num_kv_heads * head_size elements, in words.
// INVARIANT (caller): no dst is also a src within one launch (copy-on-write targets and resize
// targets are free blocks), so the pairs may run in any order.
template <typename W>
__global__ void __launch_bounds__(256) copy_blocks(
    const unsigned long long* __restrict__ cache_ptrs, const long long* __restrict__ pairs,
    long long block_words, long long num_blocks)
{
    W* cache = reinterpret_cast<W*>(cache_ptrs[blockIdx.y]);
    const long long src = pairs[2 * (long long)blockIdx.x];
    const long long dst = pairs[2 * (long long)blockIdx.x + 1];
    for (int kv = 0; kv < 2; ++kv) {
        const long long half = kv * num_blocks * block_words;
        const W* from = cache + half + src * block_words;
        W* to = cache + half + dst * block_words;
        for (long long i = threadIdx.x; i < block_words; i += blockDim.x) to[i] = from[i];
    }
}

}  // namespace pagedrs
