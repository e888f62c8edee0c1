#line 1 "cuda/moe_ops.cu"
// Fused mixture-of-experts step (vLLM's fused_moe, llama.cpp's mul_mat_id): the step's (token, slot)
// pairs sorted by expert on the device, then a grouped GEMM over the sorted rows, one CTA per (row tile,
// column block) of one expert, so each expert's weights are read once per tile of its rows.
//
//   moe_align    topk ids -> sorted pair ids, each expert's rows padded to a multiple of BM (padding
//                rows hold num_pairs), and the expert of every row tile (-1 past the last tile)
//                (vLLM's moe_align_block_size); one CTA, atomic-free, stable (an expert's pairs keep
//                their order).
//   moe_gate_up  inter[p] = act(x[p / top_k] W_gu[e]^T + b_gu[e]) for the pairs p of a tile
//   moe_down     pairs[p] = round(round(inter[p] W_d[e]^T + b_d[e]) * topk_weight[p])
//   moe_sum      out[t] = sum over j < top_k of pairs[t * top_k + j] (fp32, rounded once): the top-k
//                results reduced per token without atomics
//
// T (activations, biases, routing weights, outputs) = half_t, bf16_t or float; products accumulate in
// fp32, on tensor cores (MMA: mma.m16n8k16, sm_80+, fp16/bf16, weights dequantized to T in the tile) or
// in fp32 FMAs (any architecture and dtype). Weights: W_gu [E, 2I, H] (each expert's gate rows, then its up rows), W_d [E, H, I], in one of
// the forms WF (dequantized in the tile, in shared memory, as they are read):
//   0 dense T;
//   1 GGUF Q8_0: each row its K/32 blocks of 34 bytes (fp16 scale d, 32 int8 q), w = d * q (K % 32 == 0);
//   2 fp8 e4m3 with float32 scales per block of SR rows x SC columns (the `MoeScale`): per output row
//     (SR 1, SC >= K), or the block-FP8 checkpoints' 128 x 128 blocks (`weight_scale_inv`, as vLLM's
//     fused_moe block_shape); w = fp8 * scale (weight-only, as vLLM's W8A16).
// Gate and up are rounded to T (as a T linear layer stores them) before the activation ACT:
//   0 silu(g) * u, 1 gelu(g) * u (erf), 2 gelu_tanh(g) * u, each activation rounded to T first (as
//   torch's SiluAndMul / GeGLU); 3 gpt-oss's clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit,
//   limit), (u + 1) * g * sigmoid(alpha * g) (HF's GptOssExperts), in fp32.
// Every tensor is contiguous. Expert ids must be in [0, E) (routing produces them; not checked here).

#include "common.cuh"

namespace pagedrs {

constexpr int kMoeBK = 32;        // k per step: one Q8_0 block
constexpr int kMoeBN = 64;        // weight rows per half of a CTA's tile (a thread holds one of each)
constexpr int kMoeThreads = 256;  // 64 columns x 4 row groups
constexpr int kMoeDense = 0, kMoeQ8_0 = 1, kMoeFp8 = 2;

template <typename T> __device__ __forceinline__ float moe_rounded(float x) {
    if constexpr (sizeof(T) == 4) {
        return x;
    } else {
        return to_float(from_float<T>(x));
    }
}

__device__ __forceinline__ int moe_warp_isum(int x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
    return x;
}

// ---------------------------------------------------------------------------------------------
// grid: (1), block: a multiple of 32 (<= 1024); dynamic smem: (2 * num_experts + 1) ints.
// sorted_ids [max_tiles * block_m], tile_expert [max_tiles], max_tiles >= sum_e ceil(count_e / block_m)
// (ceil(num_pairs / block_m) + min(num_experts, num_pairs) always is).
// A warp per expert: pass 1 counts its pairs, pass 2 writes them in order (a warp prefix sum each 32).
__global__ void __launch_bounds__(1024) moe_align(
    int* __restrict__ sorted_ids, int* __restrict__ tile_expert, const long long* __restrict__ topk_ids,
    int num_pairs, int num_experts, int block_m, int max_tiles)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];
    int* counts = reinterpret_cast<int*>(pg_smem);
    int* tile_off = counts + num_experts;  // num_experts + 1: each expert's first tile, then the total
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int e = warp; e < num_experts; e += warps) {
        int n = 0;
        for (int base = 0; base < num_pairs; base += 32) {
            const int i = base + lane;
            n += moe_warp_isum(i < num_pairs && topk_ids[i] == e ? 1 : 0);
        }
        if (lane == 0) counts[e] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int tiles = 0;
        for (int e = 0; e < num_experts; ++e) {
            tile_off[e] = tiles;
            tiles += (counts[e] + block_m - 1) / block_m;
        }
        tile_off[num_experts] = tiles;
    }
    __syncthreads();
    const int tiles = tile_off[num_experts];
    for (int i = threadIdx.x; i < max_tiles; i += blockDim.x) {
        int e = -1;
        if (i < tiles) {  // the last expert whose first tile is <= i (experts without rows own none)
            int lo = 0, hi = num_experts - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (tile_off[mid] <= i) lo = mid; else hi = mid - 1;
            }
            e = lo;
        }
        tile_expert[i] = e;
    }
    const long long rows = static_cast<long long>(max_tiles) * block_m;
    for (long long i = threadIdx.x; i < rows; i += blockDim.x) sorted_ids[i] = num_pairs;
    __syncthreads();  // the padding is written before the pairs overwrite their rows
    for (int e = warp; e < num_experts; e += warps) {
        long long pos = static_cast<long long>(tile_off[e]) * block_m;
        for (int base = 0; base < num_pairs; base += 32) {
            const int i = base + lane;
            const int f = i < num_pairs && topk_ids[i] == e ? 1 : 0;
            int incl = f;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(kFull, incl, o);
                if (lane >= o) incl += v;
            }
            if (f) sorted_ids[pos + incl - 1] = i;
            pos += __shfl_sync(kFull, incl, 31);
        }
    }
}

// The fp8 form's scales: scale[(row / rows) * kblocks + k / cols] for weight element (row, k), row counting
// every expert's rows (so an expert's rows are whole blocks of `rows`), kblocks = ceil(K / cols).
struct MoeScale {
    const float* s;
    int rows, cols, kblocks;
};

__device__ __forceinline__ MoeScale moe_scale(const float* s, int rows, int cols, int K) {
    rows = imax(rows, 1);
    cols = imax(cols, 1);
    return MoeScale{s, rows, cols, (K + cols - 1) / cols};
}

// ---------------------------------------------------------------------------------------------
// Weight element (row, k) of a stacked weight of `cols` = K columns (row counts every expert's rows). fp8:
// kb is k's column block when the caller knows it for the whole k step (>= 0), else -1.
template <typename T, int WF>
__device__ __forceinline__ float moe_weight(
    const void* w, const MoeScale& sc, long long row, int k, int cols, int kb)
{
    if constexpr (WF == kMoeDense) {
        return to_float(static_cast<const T*>(w)[row * cols + k]);
    } else if constexpr (WF == kMoeFp8) {
        const long long rb = sc.rows == 1 ? row : row / sc.rows;
        const float scale = sc.s[rb * sc.kblocks + (kb >= 0 ? kb : k / sc.cols)];
        return to_float(static_cast<const fp8e4m3_t*>(w)[row * cols + k]) * scale;
    } else {
        const unsigned char* b =
            static_cast<const unsigned char*>(w) + row * (cols / 32 * 34) + (k / 32) * 34;
        const half_t d{static_cast<unsigned short>(b[0] | (b[1] << 8))};
        return to_float(d) * static_cast<float>(static_cast<signed char>(b[2 + (k & 31)]));
    }
}

// Shared memory of a GEMM CTA: BM row ids, then the A tile [BM][k] and the weight tile [2 * BN][k]:
// floats with a row of BK + 1 (the SIMT kernels: a warp's 32 weight rows in 32 banks), or T with a row
// of BK + 8 (the tensor-core kernels: 16-byte aligned rows for ldmatrix, 8 rows in distinct banks).
template <typename T, int BM, bool MMA> struct MoeSmem {
    static constexpr int kRow = MMA ? kMoeBK + 8 : kMoeBK + 1;
    static constexpr int kElem = MMA ? static_cast<int>(sizeof(T)) : 4;
    static constexpr int kIdsBytes = 4 * BM;
    static constexpr int kABytes = BM * kRow * kElem;
    static constexpr int kBytes = kIdsBytes + kABytes + 2 * kMoeBN * kRow * kElem;
};

// Fills the weight tile for the k step at k0: rows wrow_a + j (j < n_a) then wrow_b + j (j < n_b), each
// element read (and dequantized) once per CTA, as E (float or T); zero past K and past the valid rows.
template <typename T, int WF, typename E>
__device__ __forceinline__ void moe_fill_w(
    E* ws, int row, int k0, const void* __restrict__ w, const MoeScale& scale, long long wrow_a,
    long long wrow_b, int n_a, int n_b, int K)
{
    // fp8: one column block for the whole k step when blocks are whole k steps, or span every column
    const int kb = scale.cols % kMoeBK == 0 || scale.kblocks == 1 ? k0 / scale.cols : -1;
#pragma unroll 1  // unrolled, ptxas spills a few bytes (sm_90) for no gain: loads stay in flight across warps
    for (int i = threadIdx.x; i < 2 * kMoeBN * kMoeBK; i += kMoeThreads) {
        const int j = i / kMoeBK, kk = i % kMoeBK, k = k0 + kk;
        const bool second = j >= kMoeBN;
        const int jj = second ? j - kMoeBN : j;
        const bool ok = k < K && jj < (second ? n_b : n_a);
        const float v = ok ? moe_weight<T, WF>(w, scale, (second ? wrow_b : wrow_a) + jj, k, K, kb) : 0.f;
        ws[j * row + kk] = from_float<E>(v);
    }
}

// Row r of the A tile at k: a + (ids[r] / a_div) * K + k, or zero for padding rows (ids[r] >= num_pairs)
// and past K.
template <typename T>
__device__ __forceinline__ T moe_a(const T* __restrict__ a, int a_div, int p, int num_pairs, int k, int K) {
    return p < num_pairs && k < K ? a[static_cast<long long>(p / a_div) * K + k] : from_float<T>(0.f);
}

// The tile product over K: acc (BM / 2 floats a thread) += A W^T for the tile's BM rows and 2 x 64
// weight rows ("a" rows wrow_a + j, "b" rows wrow_b + j). Which outputs a thread holds: moe_acc_at.
// SIMT: thread (c = tid % 64, row group tid / 64) holds rows rg * BM/4 + r and weight rows c (a, b).
template <typename T, int WF, int BM>
__device__ __forceinline__ void moe_tile_simt(
    float (&acc)[BM / 2], unsigned char* smem, const T* __restrict__ a, int a_div, const int* ids,
    int num_pairs, const void* __restrict__ w, const MoeScale& scale, long long wrow_a,
    long long wrow_b, int n_a, int n_b, int K)
{
    using S = MoeSmem<T, BM, false>;
    constexpr int RPT = BM / 4, BK = kMoeBK, WS = S::kRow;
    float* xs = reinterpret_cast<float*>(smem + S::kIdsBytes);
    float* ws = reinterpret_cast<float*>(smem + S::kIdsBytes + S::kABytes);
    const int c = threadIdx.x % kMoeBN, rg = threadIdx.x / kMoeBN;
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = threadIdx.x; i < BM * BK; i += kMoeThreads) {
            const int r = i / BK, kk = i % BK;
            xs[r * WS + kk] = to_float(moe_a(a, a_div, ids[r], num_pairs, k0 + kk, K));
        }
        moe_fill_w<T, WF>(ws, WS, k0, w, scale, wrow_a, wrow_b, n_a, n_b, K);
        __syncthreads();
#pragma unroll 4
        for (int kk = 0; kk < BK; ++kk) {
            const float wa = ws[c * WS + kk], wb = ws[(kMoeBN + c) * WS + kk];
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                const float xv = xs[(rg * RPT + r) * WS + kk];  // one row per warp: a broadcast
                acc[2 * r] += xv * wa;
                acc[2 * r + 1] += xv * wb;
            }
        }
        __syncthreads();
    }
}

// The tensor-core tiles for the k step at k0 in 16-byte copies (cp.async; vec: K % 8 == 0 and A's and a
// dense weight's rows 16-byte aligned): A rows as moe_a, dense weight rows as moe_fill_w (quantized ones
// through moe_fill_w itself, dequantized element by element).
template <typename T, int WF, int BM>
__device__ __forceinline__ void moe_fill_vec(
    T* as, T* ws, int row, int k0, const T* __restrict__ a, int a_div, const int* ids, int num_pairs,
    const void* __restrict__ w, const MoeScale& scale, long long wrow_a, long long wrow_b,
    int n_a, int n_b, int K)
{
    constexpr int CH = kMoeBK / 8;  // 16-byte chunks per tile row
    for (int i = threadIdx.x; i < BM * CH; i += kMoeThreads) {
        const int r = i / CH, kk = (i % CH) * 8, k = k0 + kk, p = ids[r];
        const bool ok = p < num_pairs && k < K;
        cp_async16(as + r * row + kk, ok ? a + static_cast<long long>(p / a_div) * K + k : a, ok ? 16 : 0);
    }
    if constexpr (WF == kMoeDense) {
        const T* wt = static_cast<const T*>(w);
        for (int i = threadIdx.x; i < 2 * kMoeBN * CH; i += kMoeThreads) {
            const int j = i / CH, kk = (i % CH) * 8, k = k0 + kk;
            const bool second = j >= kMoeBN;
            const int jj = second ? j - kMoeBN : j;
            const bool ok = k < K && jj < (second ? n_b : n_a);
            const T* src = wt + ((second ? wrow_b : wrow_a) + jj) * K + k;
            cp_async16(ws + j * row + kk, ok ? src : wt, ok ? 16 : 0);
        }
    } else {
        moe_fill_w<T, WF>(ws, row, k0, w, scale, wrow_a, wrow_b, n_a, n_b, K);
    }
    cp_async_commit();
    cp_async_wait<0>();
}

// Tensor cores (mma.m16n8k16, fp16/bf16, sm_80+): warp w takes m-tile w / (128 / BM) (16 rows) and
// BM / 16 pairs of n8 tiles (an "a" tile of 8 weight rows and the "b" tile 64 rows below it) starting at
// pair (w % (128 / BM)) * BM / 16; acc[(q * 2 + h) * 4 + i]: pair q, half h, mma register i.
template <typename T, int WF, int BM>
__device__ __forceinline__ void moe_tile_mma(
    float (&acc)[BM / 2], unsigned char* smem, const T* __restrict__ a, int a_div, const int* ids,
    int num_pairs, const void* __restrict__ w, const MoeScale& scale, long long wrow_a,
    long long wrow_b, int n_a, int n_b, int K, bool vec)
{
    using S = MoeSmem<T, BM, true>;
    constexpr int ROW = S::kRow, NP = BM / 16, WPM = 128 / BM;
    T* as = reinterpret_cast<T*>(smem + S::kIdsBytes);
    T* ws = reinterpret_cast<T*>(smem + S::kIdsBytes + S::kABytes);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mt = warp / WPM, p0 = (warp % WPM) * NP, mi = lane >> 3, mr = lane & 7;
    for (int k0 = 0; k0 < K; k0 += kMoeBK) {
        if (vec) {
            moe_fill_vec<T, WF, BM>(as, ws, ROW, k0, a, a_div, ids, num_pairs, w, scale, wrow_a, wrow_b,
                                    n_a, n_b, K);
        } else {
            for (int i = threadIdx.x; i < BM * kMoeBK; i += kMoeThreads) {
                const int r = i / kMoeBK, kk = i % kMoeBK;
                as[r * ROW + kk] = moe_a(a, a_div, ids[r], num_pairs, k0 + kk, K);
            }
            moe_fill_w<T, WF>(ws, ROW, k0, w, scale, wrow_a, wrow_b, n_a, n_b, K);
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < kMoeBK / 16; ++ks) {
            unsigned af[4];
            ldmatrix_x4(af, as + (mt * 16 + mr + (mi & 1) * 8) * ROW + ks * 16 + (mi >> 1) * 8);
#pragma unroll
            for (int q = 0; q < NP; ++q) {
                unsigned bf[4];  // a tile's k 0-7, 8-15, then the b tile's
                ldmatrix_x4(bf, ws + ((mi >> 1) * kMoeBN + (p0 + q) * 8 + mr) * ROW + ks * 16 + (mi & 1) * 8);
                float(&da)[4] = *reinterpret_cast<float(*)[4]>(&acc[q * 8]);
                float(&db)[4] = *reinterpret_cast<float(*)[4]>(&acc[q * 8 + 4]);
                mma_16816<T>(da, af, bf[0], bf[1]);
                mma_16816<T>(db, af, bf[2], bf[3]);
            }
        }
        __syncthreads();
    }
}

// Output j (< BM / 4) of this thread: its tile row, its column (< 64) in both halves, and the indices of
// its a-half and b-half accumulators.
template <int BM, bool MMA>
__device__ __forceinline__ void moe_acc_at(int j, int& row, int& col, int& ia, int& ib) {
    if constexpr (MMA) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int q = j >> 2, i = j & 3;
        row = (warp / (128 / BM)) * 16 + (lane >> 2) + 8 * (i >> 1);
        col = ((warp % (128 / BM)) * (BM / 16) + q) * 8 + 2 * (lane & 3) + (i & 1);
        ia = q * 8 + i;
        ib = q * 8 + 4 + i;
    } else {
        row = (threadIdx.x / kMoeBN) * (BM / 4) + j;
        col = threadIdx.x % kMoeBN;
        ia = 2 * j;
        ib = 2 * j + 1;
    }
}

template <int ACT> __device__ __forceinline__ float moe_act(float g) {
    if constexpr (ACT == 0) {
        return g / (1.f + expf(-g));
    } else if constexpr (ACT == 1) {
        return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
    } else {
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.f + tanhf(inner));
    }
}

template <typename T, int ACT>
__device__ __forceinline__ float moe_glu(float g, float u, float alpha, float limit) {
    if constexpr (ACT == 3) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
    } else {
        return moe_rounded<T>(moe_act<ACT>(g)) * u;
    }
}

// Loads the tile's BM pair ids into smem.
template <int BM>
__device__ __forceinline__ void moe_load_ids(int* ids, const int* __restrict__ sorted_ids) {
    for (int r = threadIdx.x; r < BM; r += blockDim.x)
        ids[r] = sorted_ids[static_cast<long long>(blockIdx.x) * BM + r];
    __syncthreads();
}

template <typename T, int WF, int BM, bool MMA>
__device__ __forceinline__ void moe_tile(
    float (&acc)[BM / 2], unsigned char* smem, const T* a, int a_div, const int* ids, int num_pairs,
    const void* w, const MoeScale& scale, long long wrow_a, long long wrow_b, int n_a, int n_b, int K,
    bool vec)
{
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[i] = 0.f;
    if constexpr (MMA) {
        static_assert(sizeof(T) == 2, "tensor cores take fp16 / bf16");
        moe_tile_mma<T, WF, BM>(acc, smem, a, a_div, ids, num_pairs, w, scale, wrow_a, wrow_b, n_a, n_b, K,
                                vec);
    } else {
        moe_tile_simt<T, WF, BM>(acc, smem, a, a_div, ids, num_pairs, w, scale, wrow_a, wrow_b, n_a, n_b, K);
    }
}

// ---------------------------------------------------------------------------------------------
// inter [num_pairs, I] (row p: pair p) = act(gate, up). grid: (max_tiles, ceil(I / 64)), block: 256,
// dynamic smem: MoeSmem<T, BM, MMA>::kBytes. w: [E, 2I, H] (fp8: w_scale per block of scale_rows x
// scale_cols, `MoeScale`), bias [E, 2I] or null. MMA: tensor cores (sm_80+, fp16/bf16), else fp32 FMAs.
// vec: the tensor-core tiles load in 16-byte copies (hidden % 8 == 0, x and a dense w 16-byte aligned).
template <typename T, int WF, int ACT, int BM, bool MMA>
__global__ void __launch_bounds__(256) moe_gate_up(
    T* __restrict__ inter, const T* __restrict__ x, const void* __restrict__ w,
    const float* __restrict__ w_scale, const T* __restrict__ bias, const int* __restrict__ sorted_ids,
    const int* __restrict__ tile_expert, int num_pairs, int top_k, int hidden, int inter_size,
    float alpha, float limit, int vec, int scale_rows, int scale_cols)
{
    static_assert(BM == 16 || BM == 64, "row tiles of 16 or 64");
    extern __shared__ __align__(16) unsigned char pg_smem[];
    const int e = tile_expert[blockIdx.x];
    if (e < 0) return;  // past the last tile: the whole CTA, before any barrier
    int* ids = reinterpret_cast<int*>(pg_smem);
    moe_load_ids<BM>(ids, sorted_ids);
    const int n0 = blockIdx.y * kMoeBN;
    const int nv = imin(kMoeBN, inter_size - n0);
    const long long erow = static_cast<long long>(e) * 2 * inter_size;
    float acc[BM / 2];
    const MoeScale sc = moe_scale(w_scale, scale_rows, scale_cols, hidden);
    moe_tile<T, WF, BM, MMA>(acc, pg_smem, x, top_k, ids, num_pairs, w, sc, erow + n0,
                             erow + inter_size + n0, nv, nv, hidden, vec != 0);
#pragma unroll
    for (int j = 0; j < BM / 4; ++j) {
        int row, col, ia, ib;
        moe_acc_at<BM, MMA>(j, row, col, ia, ib);
        const int p = ids[row];
        if (p >= num_pairs || col >= nv) continue;
        const int n = n0 + col;
        const float bg = bias != nullptr ? to_float(bias[erow + n]) : 0.f;
        const float bu = bias != nullptr ? to_float(bias[erow + inter_size + n]) : 0.f;
        const float g = moe_rounded<T>(acc[ia] + bg), u = moe_rounded<T>(acc[ib] + bu);
        inter[static_cast<long long>(p) * inter_size + n] = from_float<T>(moe_glu<T, ACT>(g, u, alpha, limit));
    }
}

// pairs [num_pairs, H] (row p: pair p) = round(round(inter[p] W_d[e]^T + b_d[e]) * topk_weights[p]).
// grid: (max_tiles, ceil(H / 128)), block: 256, dynamic smem: MoeSmem<T, BM, MMA>::kBytes. w: [E, H, I]
// (fp8: w_scale per block of scale_rows x scale_cols), bias [E, H] or null; topk_weights [num_pairs].
// vec: as moe_gate_up's, for inter_size, inter and w.
template <typename T, int WF, int BM, bool MMA>
__global__ void __launch_bounds__(256) moe_down(
    T* __restrict__ pairs, const T* __restrict__ inter, const void* __restrict__ w,
    const float* __restrict__ w_scale, const T* __restrict__ bias, const T* __restrict__ topk_weights,
    const int* __restrict__ sorted_ids, const int* __restrict__ tile_expert, int num_pairs, int hidden,
    int inter_size, int vec, int scale_rows, int scale_cols)
{
    static_assert(BM == 16 || BM == 64, "row tiles of 16 or 64");
    extern __shared__ __align__(16) unsigned char pg_smem[];
    const int e = tile_expert[blockIdx.x];
    if (e < 0) return;
    int* ids = reinterpret_cast<int*>(pg_smem);
    moe_load_ids<BM>(ids, sorted_ids);
    const int n0 = blockIdx.y * 2 * kMoeBN;
    const int na = imax(0, imin(kMoeBN, hidden - n0));
    const int nb = imax(0, imin(kMoeBN, hidden - n0 - kMoeBN));
    const long long erow = static_cast<long long>(e) * hidden;
    float acc[BM / 2];
    const MoeScale sc = moe_scale(w_scale, scale_rows, scale_cols, inter_size);
    moe_tile<T, WF, BM, MMA>(acc, pg_smem, inter, 1, ids, num_pairs, w, sc, erow + n0,
                             erow + n0 + kMoeBN, na, nb, inter_size, vec != 0);
#pragma unroll
    for (int j = 0; j < BM / 4; ++j) {
        int row, col, ia, ib;
        moe_acc_at<BM, MMA>(j, row, col, ia, ib);
        const int p = ids[row];
        if (p >= num_pairs) continue;
        const float tw = to_float(topk_weights[p]);
        T* out = pairs + static_cast<long long>(p) * hidden + n0 + col;
        if (col < na) {
            const float b = bias != nullptr ? to_float(bias[erow + n0 + col]) : 0.f;
            out[0] = from_float<T>(moe_rounded<T>(acc[ia] + b) * tw);
        }
        if (col < nb) {
            const float b = bias != nullptr ? to_float(bias[erow + n0 + kMoeBN + col]) : 0.f;
            out[kMoeBN] = from_float<T>(moe_rounded<T>(acc[ib] + b) * tw);
        }
    }
}

// out [T, H] = sum over j < top_k of pairs[t * top_k + j] in slot order, fp32, rounded once.
// grid: (num_tokens, column blocks), block: a multiple of 32.
template <typename T>
__global__ void __launch_bounds__(256) moe_sum(
    T* __restrict__ out, const T* __restrict__ pairs, int top_k, int hidden)
{
    const long long t = blockIdx.x;
    for (int n = blockIdx.y * blockDim.x + threadIdx.x; n < hidden; n += gridDim.y * blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < top_k; ++j) s += to_float(pairs[(t * top_k + j) * hidden + n]);
        out[t * hidden + n] = from_float<T>(s);
    }
}

}  // namespace pagedrs
