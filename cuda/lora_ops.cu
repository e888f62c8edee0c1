#line 1 "cuda/lora_ops.cu"
// LoRA deltas of a batch that mixes adapters, as punica's BGMV (one adapter per row, gathered by the
// row's slot): a shrink and an expand launch per layer.
//
//   shrink: s[row, k] = sum_i x[row, i] * A[slot, k, i]                  (s float32 [rows, rank])
//   expand: out[row, first + c] += sum_k s[row, k] * Bt[slot, k, c]
//           over the rank rows k with cols[k][0] <= c < cols[k][1]
//
// slot = slot_of_row[row] (int32); a row of slot -1 (the base model) is skipped by both, its output and
// its scratch row left alone. A [num_slots, rank, in] and Bt [num_slots, rank, width] (B^T with the
// scaling folded in) are every slot's pair over all slices of a module, rank = the slices' ranks summed;
// cols gives each rank row's output columns [start, end) within 0..width, so a slice's rank rows expand
// only into its own columns (the zeros of the block-diagonal B are skipped, as the CPU kernel in
// rust/pagedrs-cpu/src/lora.rs does).
//
// T = half_t, bf16_t or float for x, A, Bt and out; products and sums in fp32 (s stays fp32 between the
// launches), each output element rounded to T once, after its delta is added. Every row's sums run in a
// fixed order whatever the other rows, so a row gets the same bits alone or in any batch.
//
// Every row is its own CTAs (BGMV), for decodes and prefill chunks alike: a long chunk reads its
// adapter's A and Bt once per row (from L2). punica's SGMV (rows grouped by slot, each A/Bt tile loaded
// once for a group's rows, tensor cores) is what would reuse them for long chunks.
//
// VEC = elements per access: 16 / sizeof(T) (16-byte vectors) when the sizes, strides and addresses
// allow it, else 1 (the Python wrappers choose).

#include "common.cuh"

namespace pagedrs {

template <typename T, int N> struct alignas(sizeof(T) * N) LoraPack {
    T v[N];
};

// ---------------------------------------------------------------------------------------------
// Shrink. grid: (rows, ceil(rank / warps per CTA)), block: a multiple of 32 (<= 256); warp w of CTA
// (row, y) computes s[row, y * warps + w], its lanes striding over `in` (coalesced along it), then a
// warp sum. x rows at x_stride elements; s contiguous [rows, rank]; in % VEC == 0.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) lora_shrink(
    float* __restrict__ s, const T* __restrict__ x, const T* __restrict__ a,
    const int* __restrict__ slot_of_row, long long x_stride, int in, int rank, int num_slots)
{
    using P = LoraPack<T, VEC>;
    const long long row = blockIdx.x;
    const int slot = slot_of_row[row];
    // A slot outside 0..num_slots (a caller's bug; not checked on the host, that would synchronize) is
    // skipped like the base model's -1 rather than read outside A.
    if (slot < 0 || slot >= num_slots) return;
    const int lane = threadIdx.x & 31;
    const int k = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (k >= rank) return;  // the whole warp: no barrier follows, only the warp's own shuffles
    const P* xr = reinterpret_cast<const P*>(x + row * x_stride);
    const P* ar = reinterpret_cast<const P*>(a + (static_cast<long long>(slot) * rank + k) * in);
    const int nvec = in / VEC;
    float acc = 0.f;
    for (int i = lane; i < nvec; i += 32) {
        const P xv = xr[i];
        const P av = ar[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc += to_float(xv.v[j]) * to_float(av.v[j]);
    }
    acc = warp_sum(acc);
    if (lane == 0) s[row * rank + k] = acc;
}

// ---------------------------------------------------------------------------------------------
// Expand. grid: (rows, column blocks), block: a multiple of 32; each thread owns VEC adjacent columns
// (coalesced along width) and runs over the rank rows in order. dynamic smem: rank floats (the row's s)
// then 2 * rank ints (cols). out rows at out_stride elements, columns first .. first + width; Bt
// contiguous; width % VEC == 0, first % VEC == 0.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) lora_expand(
    T* __restrict__ out, const float* __restrict__ s, const T* __restrict__ bt,
    const int* __restrict__ slot_of_row, const int* __restrict__ cols, long long out_stride, int first,
    int width, int rank, int num_slots)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];
    using P = LoraPack<T, VEC>;
    const long long row = blockIdx.x;
    const int slot = slot_of_row[row];
    if (slot < 0 || slot >= num_slots) return;  // the whole CTA, before its barrier (see lora_shrink)
    float* sr = reinterpret_cast<float*>(pg_smem);
    int* cr = reinterpret_cast<int*>(sr + rank);
    for (int k = threadIdx.x; k < rank; k += blockDim.x) {
        sr[k] = s[row * rank + k];
        cr[2 * k] = cols[2 * k];
        cr[2 * k + 1] = cols[2 * k + 1];
    }
    __syncthreads();
    const int v = blockIdx.y * blockDim.x + threadIdx.x;
    if (v >= width / VEC) return;
    const int c = v * VEC;
    const T* b = bt + static_cast<long long>(slot) * rank * width + c;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    for (int k = 0; k < rank; ++k) {
        const int c0 = cr[2 * k], c1 = cr[2 * k + 1];
        if (c + VEC <= c0 || c >= c1) continue;  // none of this thread's columns: skip the load
        const P w = *reinterpret_cast<const P*>(b + static_cast<long long>(k) * width);
        const float sk = sr[k];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            if (c + j >= c0 && c + j < c1) acc[j] += sk * to_float(w.v[j]);
    }
    P* o = reinterpret_cast<P*>(out + row * out_stride + first + c);
    P ov = *o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) ov.v[j] = from_float<T>(to_float(ov.v[j]) + acc[j]);
    *o = ov;
}

}  // namespace pagedrs
