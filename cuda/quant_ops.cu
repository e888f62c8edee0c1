#line 1 "cuda/quant_ops.cu"
// Dequantization of GPTQ and AWQ integer weights into a dense, transposed weight Wt [in, out] (row
// major), so a layer keeps the packed weights on the GPU and multiplies x @ Wt with cuBLAS.
//
// W[c, r] = scale[g, c] * (q[r, c] - zero[g, c]) for input row r, output column c and group g of r:
// (q - zero) in integers, converted to fp32, times the fp32 scale, rounded once to T. So a float32
// result equals the loader's dequantize_gptq / dequantize_awq (python/pagedrs/loader/quant_weights.py)
// exactly and a 16-bit one is that float32 weight rounded to T.
//
// T (the output) and TS (the scales) = half_t, bf16_t or float, independently. Every tensor is
// contiguous; group ids are not range-checked here (the loader checks them).

#include "common.cuh"

namespace pagedrs {

template <typename T, int N> struct alignas(16) QuantPack {
    T v[N];
};

// ---------------------------------------------------------------------------------------------
// GPTQ, BITS = 2, 4 or 8 (AutoGPTQ's v1 zero points with zero_add = 1, GPTQModel's v2 with 0).
// qweight int32 [in_words, out]: packed along the input dim, value j of word [w, c] (bits
// [j*BITS, (j+1)*BITS)) is input row w * (32/BITS) + j. qzeros int32 [groups, ceil(out / (32/BITS))]:
// packed along the output dim the same way; zero = stored + zero_add. scales [groups, out];
// g_idx int32 [in_words * 32/BITS]: each input row's group (act-order permutes them).
// One thread per word: it writes column c of its 32/BITS rows, coalesced across the warp's columns.
// grid: (ceil(out / blockDim.x), word-row blocks), block: a multiple of 32.
template <typename T, typename TS, int BITS>
__global__ void __launch_bounds__(256) dequantize_gptq(
    T* __restrict__ out, const int* __restrict__ qweight, const int* __restrict__ qzeros,
    const TS* __restrict__ scales, const int* __restrict__ g_idx, int in_words, int out_features,
    int zero_add)
{
    static_assert(BITS == 2 || BITS == 4 || BITS == 8, "GPTQ dequantization packs 2, 4 or 8 bits");
    constexpr int PER_WORD = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= out_features) return;
    const long long zero_words = (out_features + PER_WORD - 1) / PER_WORD;
    const int zero_shift = (c % PER_WORD) * BITS;
    for (int w = blockIdx.y; w < in_words; w += gridDim.y) {
        const unsigned word = static_cast<unsigned>(qweight[static_cast<long long>(w) * out_features + c]);
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
            const long long r = static_cast<long long>(w) * PER_WORD + j;
            const long long g = g_idx[r];
            const int zero =
                static_cast<int>((static_cast<unsigned>(qzeros[g * zero_words + c / PER_WORD]) >> zero_shift) &
                                 MASK) + zero_add;
            const int q = static_cast<int>((word >> (j * BITS)) & MASK);
            const float s = to_float(scales[g * out_features + c]);
            out[r * out_features + c] = from_float<T>(static_cast<float>(q - zero) * s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AWQ, 4 bits, AutoAWQ's GEMM layout. qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8]:
// packed along the output dim, nibble i of a word holding column (0, 2, 4, 6, 1, 3, 5, 7)[i] of its
// 8 (column k in nibble (k / 2) + 4 * (k % 2)); zero points stored as is. scales [groups, out];
// the group of input row r is r / group_size.
// One thread per word: it writes the word's 8 columns of one row as one vector (out 16-byte
// aligned). grid: (ceil(out_words / blockDim.x), row blocks), block: a multiple of 32.
template <typename T, typename TS>
__global__ void __launch_bounds__(256) dequantize_awq(
    T* __restrict__ out, const int* __restrict__ qweight, const int* __restrict__ qzeros,
    const TS* __restrict__ scales, int in_features, int out_words, int group_size)
{
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= out_words) return;
    const long long out_features = static_cast<long long>(out_words) * 8;
    for (int r = blockIdx.y; r < in_features; r += gridDim.y) {
        const long long g = r / group_size;
        const unsigned word = static_cast<unsigned>(qweight[static_cast<long long>(r) * out_words + w]);
        const unsigned zeros = static_cast<unsigned>(qzeros[g * out_words + w]);
        const TS* s = scales + g * out_features + static_cast<long long>(w) * 8;
        QuantPack<T, 8> o;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int shift = 4 * ((k >> 1) + 4 * (k & 1));
            const int q = static_cast<int>((word >> shift) & 0xfu);
            const int zero = static_cast<int>((zeros >> shift) & 0xfu);
            o.v[k] = from_float<T>(static_cast<float>(q - zero) * to_float(s[k]));
        }
        *reinterpret_cast<QuantPack<T, 8>*>(out + r * out_features + static_cast<long long>(w) * 8) = o;
    }
}

}  // namespace pagedrs
