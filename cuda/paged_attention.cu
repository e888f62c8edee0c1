#line 1 "cuda/paged_attention.cu"
// Paged attention over the KV cache: decode (up to a few query tokens per request, split-K) and
// varlen prefill (longer query chunks, causal over the cached prefix plus the new tokens).
//
// Shapes (T = tokens in the step, B = requests, H query heads, KVH kv heads, G = H / KVH):
//   q            [T, H, HEAD]  head and dim contiguous; token stride q_stride (elements)
//   out          [T, H, HEAD]  contiguous
//   k/v cache    [num_blocks, block_size, KVH, HEAD]  (one half of a layer's [2, ...] tensor)
//   block_tables [B, block_table_stride] int32;  seq_lens [B] int32;  query_start_loc [B+1] int32
// Request b owns tokens query_start_loc[b] .. query_start_loc[b+1]-1; its context is seq_lens[b]
// keys and its query i sits at position seq_lens[b] - q_len + i. A query at position p sees keys
// [p - sliding_window + 1, p] (all of [0, p] when sliding_window <= 0).
// Requests with 1 <= q_len <= max_decode_query (a launch argument, at most DECODE_MAX_QUERY in
// attention_ops.py) belong to the decode kernel: one decode step (q_len 1), or a speculative
// verification (the last token and the k drafts, q_len k + 1), as vLLM's decode kernels take a few
// query tokens per request. Longer requests belong to a prefill kernel. Each kernel skips the other's
// requests, so both can be launched on a mixed batch with no host-side split. A request with
// seq_len 0 (CUDA-graph padding) gets a zero output.
// Softmax runs in fp32 in base 2: logits are pre-multiplied by scale * log2(e) (scale_log2).
// Attention-logit soft-capping (HF's Gemma 2: s = cap * tanh(s / cap) on the scaled scores before the
// softmax): the instances with CAP = true take soft_cap_log2 = cap * log2(e) and scale_log2 =
// scale / cap, and a logit becomes soft_cap_log2 * tanh(q.k * scale_log2) (soft_cap<CAP>()). With CAP
// false (every model without soft-capping) the argument is unread and the code is that of a kernel
// without it.
//
// An fp8 KV cache (kv_cache_dtype fp8 = e4m3, or e5m2): every attention kernel takes the cache's
// element type C next to the activations' type T (C = T otherwise); K/V are widened as they are
// loaded (to fp32, or to T for the tensor cores). reshape_and_cache_fp8 writes it: round to nearest even,
// saturating at the largest finite value, per-tensor scale 1.0 (as the torch backend).
//
// Types, conversions and PTX helpers come from common.cuh (inlined by kernel_source(), so NVRTC
// needs no include directory).

#include "common.cuh"

namespace pagedrs {

constexpr int kThreads = 128;  // every kernel here runs 4 warps
constexpr int kWarps = kThreads / 32;

// Slot (block * block_size + offset) of token position t of a request, through its block table.
__device__ __forceinline__ long long slot_of(const int* bt, int t, int block_shift) {
    return (static_cast<long long>(bt[t >> block_shift]) << block_shift) +
           (t & ((1 << block_shift) - 1));
}

// A logit x = q.k * scale_log2 in base 2, soft-capped with CAP (see the top).
template <bool CAP>
__device__ __forceinline__ float soft_cap(float x, float soft_cap_log2) {
    if constexpr (CAP) {
        return soft_cap_log2 * tanhf(x);
    } else {
        return x;
    }
}

// First key a query at position pos sees.
__device__ __forceinline__ int window_lo(int pos, int sliding_window) {
    return sliding_window > 0 ? imax(0, pos + 1 - sliding_window) : 0;
}

// A decode request: its q_len queries sit at positions pos0 .. ctx - 1 and see, together, keys
// [start, ctx) (start: the window's edge for query 0), cut into num_parts partitions of
// partition_size keys from start. False for a prefill request (q_len > max_query) or an empty one.
struct DecodeSeq {
    int q_begin, q_len, ctx, pos0, start, num_parts;
};
__device__ __forceinline__ bool decode_seq(int b, const int* query_start_loc, const int* seq_lens,
                                           int max_query, int sliding_window, int partition_size,
                                           DecodeSeq& s)
{
    s.q_begin = query_start_loc[b];
    s.q_len = query_start_loc[b + 1] - s.q_begin;
    if (s.q_len < 1 || s.q_len > max_query) return false;
    s.ctx = seq_lens[b];
    s.pos0 = s.ctx - s.q_len;
    s.start = window_lo(s.pos0, sliding_window);
    s.num_parts = (s.ctx - s.start + partition_size - 1) / partition_size;  // 0: padding (ctx 0)
    return true;
}

// Split-K scratch row of query qi of decode request b. One-token instance (MQ false): b, in [0, B).
// Multi-query: min(q_begin, b * max_query) + qi, in [0, min(T, B * max_query)). INVARIANT:
// distinct queries get distinct rows, since every earlier request's rows lie below both q_begin
// (its tokens come first) and b * max_query (at most max_query rows each, starting at or below
// b' * max_query).
template <bool MQ>
__device__ __forceinline__ long long decode_tmp_row(int b, int q_begin, int max_query, int qi) {
    return MQ ? imin(q_begin, b * max_query) + qi : b;
}

// ---------------------------------------------------------------------------------------------
// Decode. grid: (B, KVH * chunks, max_parts), block: 128, chunks = ceil(max_query * G / GP).
// Two instances per (T, HEAD, GP, C): MQ false, launched when every decode request of the step has
// one query (max_query 1, the argument unread): the one-token decode, whose rows are the G heads of
// kv head kh; MQ true when some request has 2..max_query (speculative verification). With MQ false
// every multi-query term below folds away at compile time, so the instance that serves (and CUDA
// graphs capture for) plain decode keeps the registers of a one-query kernel.
// A request's rows for kv head kh are its q_len * G (query, head) pairs, query-major (row r =
// query r / G, head kh * G + r % G); a CTA computes up to GP of them, rows [r0, r0 + GP),
// r0 = (blockIdx.y % chunks) * GP, so each K/V row is read once per GP rows.
// Partition p of the request holds keys [start + p * partition_size, ...) (DecodeSeq); a CTA reads
// the part its rows see (from its first row's window edge to its last row's position) and each row
// takes only its own keys [window_lo(pos), pos] into the softmax: no per-key mask, the other keys'
// weights are zeroed. A CTA whose rows see none of the partition exits (the reduce reads only the
// partitions a query sees).
// max_parts == 1: writes out directly. Otherwise writes tmp_out [R, H, max_parts, HEAD] (normalized
// by its own sum), max_logits and exp_sums [R, H, max_parts] at row decode_tmp_row<MQ> (R = B, or
// min(T, B * max_query) with MQ), and paged_attention_reduce<T, HEAD, MQ> combines them. CTAs past a
// request's rows or partition count exit, so the grid may be sized for the longest possible context
// and query (CUDA graphs).
// The partition's slots are looked up once, up front (all block-table reads in flight together),
// into shared memory for K and V; K rows are read as 16-byte chunks by 4 lanes each, V rows as
// 16-byte (8 with many rows or fp8) chunks, two rows per lane group in flight. With MQ, padding
// rows (past the request's rows) cost a warp-uniform test per key step, no arithmetic.
// Dynamic smem (4-byte words): q_s[GP*HEAD] | logits[max(GP*partition_size, kWarps*GP*HEAD)] |
// max[GP] | sum[GP] | (MQ only: dst[GP] (8-byte) | lo[GP] | hi[GP]) | slots[partition_size]
// (decode_smem_bytes() in attention_ops.py).
template <typename T, int HEAD, int GP, typename C = T, bool MQ = false, bool CAP = false>
__global__ void __launch_bounds__(kThreads) paged_attention_decode(
    T* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ max_logits,
    float* __restrict__ exp_sums, const T* __restrict__ q, long long q_stride,
    const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int* __restrict__ block_tables, int block_table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc, int num_heads, int num_kv_heads, int block_shift,
    int sliding_window, float scale_log2, int partition_size, int max_parts, int max_query,
    float soft_cap_log2)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];
    const int b = blockIdx.x;
    const int q_begin = query_start_loc[b];
    const int q_len = query_start_loc[b + 1] - q_begin;
    if (q_len < 1 || q_len > (MQ ? max_query : 1)) return;  // a prefill request

    const int G = num_heads / num_kv_heads;
    const int chunks = ((MQ ? max_query : 1) * G + GP - 1) / GP;
    const int kh = blockIdx.y / chunks;
    const int r0 = (blockIdx.y % chunks) * GP;
    const int ng = imin(GP, (MQ ? q_len : 1) * G - r0);  // real rows here; rows ng..GP-1 are padding
    if (MQ && ng <= 0) return;
    const int h0 = kh * G + r0;  // one query: the first head here
    const int ctx = seq_lens[b];
    const int pos0 = ctx - (MQ ? q_len : 1);  // the first query's position
    const int start = window_lo(pos0, sliding_window);
    const int num_parts = (ctx - start + partition_size - 1) / partition_size;
    const int p = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // Row gi of this CTA: query token q_begin + row_query(gi), head row_head(gi).
    auto row_query = [&](int gi) { return MQ ? (r0 + gi) / G : 0; };
    auto row_head = [&](int gi) { return MQ ? kh * G + (r0 + gi) % G : h0 + gi; };
    T* out_row = out + (static_cast<long long>(q_begin) * num_heads + h0) * HEAD;  // one query

    if (num_parts == 0) {  // empty context (padding): zero output; split mode leaves it to reduce
        if (max_parts == 1 && p == 0)
            for (int i = tid; i < ng * HEAD; i += kThreads) {
                const int gi = i / HEAD;
                const long long row = static_cast<long long>(q_begin + row_query(gi)) * num_heads;
                (MQ ? out[(row + row_head(gi)) * HEAD + i % HEAD] : out_row[i]) = from_float<T>(0.f);
            }
        return;
    }
    if (p >= num_parts) return;

    // Keys [ts, te) of partition p that some row here sees (with one query: all of them).
    int ts = start + p * partition_size, te = imin(ts + partition_size, ctx);
    if constexpr (MQ) {
        ts = imax(ts, window_lo(pos0 + row_query(0), sliding_window));
        te = imin(te, pos0 + row_query(ng - 1) + 1);
        if (ts >= te) return;
    }
    const int n = te - ts;

    float* q_s = reinterpret_cast<float*>(pg_smem);
    float* logits = q_s + GP * HEAD;  // [GP][partition_size], later the cross-warp buffer
    const int logits_size = imax(GP * partition_size, kWarps * GP * HEAD);
    float* s_max = logits + logits_size;
    float* s_sum = s_max + GP;
    // MQ: per row, worked out once (not held in registers through the loops): where its result goes
    // (out element, or split mode: its scratch row * max_parts + p) and its keys [lo, hi) - ts
    // within [0, n).
    long long* s_dst = reinterpret_cast<long long*>(s_sum + GP);  // 8-byte aligned: even offset
    int* s_lo = reinterpret_cast<int*>(s_dst + GP);
    int* s_hi = s_lo + GP;
    // slot of key ts + i (< 2^31 slots in a pool)
    int* s_slot = MQ ? s_hi + GP : reinterpret_cast<int*>(s_sum + GP);

    const T* q_row = q + static_cast<long long>(q_begin) * q_stride + static_cast<long long>(h0) * HEAD;
    const int* bt = block_tables + static_cast<long long>(b) * block_table_stride;
    for (int i = tid; i < n; i += kThreads) s_slot[i] = static_cast<int>(slot_of(bt, ts + i, block_shift));
    if constexpr (MQ) {
        if (tid < ng) {
            const int qi = row_query(tid), h = row_head(tid), pos = pos0 + qi;
            const long long tmp_row = decode_tmp_row<MQ>(b, q_begin, max_query, qi);
            s_dst[tid] = max_parts == 1 ? (static_cast<long long>(q_begin + qi) * num_heads + h) * HEAD
                                        : (tmp_row * num_heads + h) * max_parts + p;
            s_lo[tid] = imin(imax(window_lo(pos, sliding_window) - ts, 0), n);
            s_hi[tid] = imax(imin(pos + 1 - ts, n), s_lo[tid]);
        }
        for (int i = tid; i < GP * HEAD; i += kThreads) {
            const int gi = i / HEAD;
            const long long at = static_cast<long long>(q_begin + row_query(gi)) * q_stride +
                                 static_cast<long long>(row_head(gi)) * HEAD + i % HEAD;
            q_s[i] = gi < ng ? to_float(q[at]) * scale_log2 : 0.f;
        }
    } else {
        for (int i = tid; i < GP * HEAD; i += kThreads)
            q_s[i] = i / HEAD < ng ? to_float(q_row[i]) * scale_log2 : 0.f;
    }
    __syncthreads();

    const long long kv_row = static_cast<long long>(num_kv_heads) * HEAD;  // elements per slot
    const C* k_head = k_cache + static_cast<long long>(kh) * HEAD;
    const C* v_head = v_cache + static_cast<long long>(kh) * HEAD;

    // Logits. KL lanes share one key row, each loading 16-byte chunks kl, kl + KL, ...;
    // a warp covers KTW keys per step. The loop bound is warp-uniform (shuffles inside).
    constexpr int KV = 16 / sizeof(C);       // elements per 16-byte chunk
    constexpr int KC = HEAD / KV;            // chunks per row
    constexpr int KL = 4;                    // lanes per key
    constexpr int KCL = (KC + KL - 1) / KL;  // chunks per lane
    constexpr int KTW = 32 / KL;             // keys per warp step
    const int kl = lane % KL;
    for (int base = ts + warp * KTW; base < te; base += kWarps * KTW) {
        const int t = base + lane / KL;
        const bool valid = t < te;
        float kf[KCL * KV];
        const C* k_row = k_head + (valid ? static_cast<long long>(s_slot[t - ts]) * kv_row : 0);
#pragma unroll
        for (int c = 0; c < KCL; ++c) {
            const int chunk = kl + c * KL;
            if (valid && chunk < KC) {
                load_floats<C, 16>(k_row + chunk * KV, kf + c * KV);
            } else {
#pragma unroll
                for (int e = 0; e < KV; ++e) kf[c * KV + e] = 0.f;
            }
        }
#pragma unroll
        for (int gi = 0; gi < GP; ++gi) {
            if (MQ && gi >= ng) break;  // CTA-uniform
            float acc = 0.f;
#pragma unroll
            for (int c = 0; c < KCL; ++c) {
                const int chunk = kl + c * KL;
                if (chunk < KC) {
#pragma unroll
                    for (int e = 0; e < KV; ++e)
                        acc += q_s[gi * HEAD + chunk * KV + e] * kf[c * KV + e];
                }
            }
            acc += __shfl_xor_sync(kFull, acc, 1);
            acc += __shfl_xor_sync(kFull, acc, 2);
            if (valid && kl == 0) logits[gi * partition_size + (t - ts)] = soft_cap<CAP>(acc, soft_cap_log2);
        }
    }
    __syncthreads();

    // Softmax numerators in place, one warp per row, over the row's own keys: logits [i0, i1) are
    // keys [window_lo(pos), pos] (all of [0, n) with one query); the keys outside get weight 0. A
    // row that sees none of them keeps max -inf and sum 0.
    for (int gi = warp; gi < ng; gi += kWarps) {
        const int i0 = MQ ? s_lo[gi] : 0, i1 = MQ ? s_hi[gi] : n;
        float* l = logits + gi * partition_size;
        float m = neg_inf();
        for (int i = i0 + lane; i < i1; i += 32) m = fmaxf(m, l[i]);
        m = warp_max(m);
        float s = 0.f;
        for (int i = i0 + lane; i < i1; i += 32) {
            const float e = exp2f(l[i] - m);
            l[i] = e;
            s += e;
        }
        if (MQ) {
            for (int i = lane; i < i0; i += 32) l[i] = 0.f;
            for (int i = i1 + lane; i < n; i += 32) l[i] = 0.f;
        }
        s = warp_sum(s);
        if (lane == 0) {
            s_max[gi] = m;
            s_sum[gi] = s;
        }
    }
    __syncthreads();

    // Weighted V. VL lanes share one value row (VB-byte chunks vl, vl + VL, ...); VTW rows per
    // warp step, VU steps' rows loaded before any is used; each lane accumulates its chunks for all
    // GP rows (VB = 8 where 16-byte chunks would take more than 64 accumulators).
    constexpr int VB = GP * (16 / static_cast<int>(sizeof(C))) <= 64 ? 16 : 8;
    constexpr int VV = VB / sizeof(C);  // elements per chunk
    constexpr int VC = HEAD / VV;
    constexpr int VL = VC > 16 ? 32 : VC > 8 ? 16 : VC > 4 ? 8 : VC > 2 ? 4 : VC > 1 ? 2 : 1;  // pow2 >= VC
    constexpr int VCL = (VC + VL - 1) / VL;
    constexpr int VTW = 32 / VL;
    constexpr int VU = 2;
    const int vl = lane % VL;
    float acc[GP][VCL * VV];
#pragma unroll
    for (int gi = 0; gi < GP; ++gi)
#pragma unroll
        for (int e = 0; e < VCL * VV; ++e) acc[gi][e] = 0.f;
    for (int base = ts + warp * VTW; base < te; base += kWarps * VTW * VU) {
        float vf[VU][VCL * VV];
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            const int t = base + u * kWarps * VTW + lane / VL;
            const C* v_row = v_head + (t < te ? static_cast<long long>(s_slot[t - ts]) * kv_row : 0);
#pragma unroll
            for (int c = 0; c < VCL; ++c) {
                const int chunk = vl + c * VL;
                if (t < te && chunk < VC) {
                    load_floats<C, VB>(v_row + chunk * VV, vf[u] + c * VV);
                } else {
#pragma unroll
                    for (int e = 0; e < VV; ++e) vf[u][c * VV + e] = 0.f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            const int t = base + u * kWarps * VTW + lane / VL;
            if (t < te) {
#pragma unroll
                for (int gi = 0; gi < GP; ++gi) {
                    if (MQ && gi >= ng) break;  // CTA-uniform; padding rows keep zeros
                    const float w = logits[gi * partition_size + (t - ts)];
#pragma unroll
                    for (int e = 0; e < VCL * VV; ++e) acc[gi][e] += w * vf[u][e];
                }
            }
        }
    }
    // Sum the VTW key groups of each warp, then the warps through shared memory.
#pragma unroll
    for (int o = VL; o < 32; o <<= 1)
#pragma unroll
        for (int gi = 0; gi < GP; ++gi)
#pragma unroll
            for (int e = 0; e < VCL * VV; ++e) acc[gi][e] += __shfl_xor_sync(kFull, acc[gi][e], o);
    __syncthreads();  // every warp is done reading logits before they are overwritten
    float* red = logits;  // [kWarps][GP][HEAD]
    if (lane < VL) {
#pragma unroll
        for (int gi = 0; gi < GP; ++gi)
#pragma unroll
            for (int c = 0; c < VCL; ++c) {
                const int chunk = vl + c * VL;
                if (chunk < VC)
#pragma unroll
                    for (int e = 0; e < VV; ++e)
                        red[(warp * GP + gi) * HEAD + chunk * VV + e] = acc[gi][c * VV + e];
            }
    }
    __syncthreads();

    for (int i = tid; i < ng * HEAD; i += kThreads) {
        const int gi = i / HEAD;
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) o += red[w * GP * HEAD + i];
        if constexpr (MQ) {
            // sum >= 1 where the row sees a key (its max contributes exp2(0)); 0 where it sees none
            // (a partition the reduce does not read for this query)
            o = s_sum[gi] > 0.f ? o / s_sum[gi] : 0.f;
            if (max_parts == 1) {
                out[s_dst[gi] + i % HEAD] = from_float<T>(o);
            } else {
                tmp_out[s_dst[gi] * HEAD + i % HEAD] = o;
            }
        } else {
            o /= s_sum[gi];  // >= 1: the max key contributes exp2(0)
            if (max_parts == 1) {
                out_row[i] = from_float<T>(o);
            } else {
                const long long row = (static_cast<long long>(b) * num_heads + h0 + gi) * max_parts + p;
                tmp_out[row * HEAD + i % HEAD] = o;
            }
        }
    }
    if (max_parts > 1 && tid < ng) {
        const long long row =
            MQ ? s_dst[tid] : (static_cast<long long>(b) * num_heads + h0 + tid) * max_parts + p;
        max_logits[row] = s_max[tid];
        exp_sums[row] = s_sum[tid];
    }
}

// Combines the partitions query qi of decode request b sees, p0 .. p0 + num_parts - 1 of the
// request's (all of them with one query; p0 is 0 while a partition holds more keys than the request
// has queries, as the host sizes them; a partition past the query's position holds nothing for it):
// out = sum_p w_p * tmp_p / sum_p w_p, w_p = sum_p * 2^(max_p - max). MQ as the decode kernel's.
// grid: (B, H, max_query), block: 128, dynamic smem: (max_parts + kWarps) floats.
template <typename T, int HEAD, bool MQ = false>
__global__ void __launch_bounds__(kThreads) paged_attention_reduce(
    T* __restrict__ out, const float* __restrict__ tmp_out, const float* __restrict__ max_logits,
    const float* __restrict__ exp_sums, const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc, int num_heads, int sliding_window, int partition_size,
    int max_parts, int max_query)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];
    const int b = blockIdx.x, h = blockIdx.y, qi = MQ ? blockIdx.z : 0;
    DecodeSeq sq;
    if (!decode_seq(b, query_start_loc, seq_lens, MQ ? max_query : 1, sliding_window, partition_size,
                    sq) ||
        (MQ && qi >= sq.q_len))
        return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    T* o = out + (static_cast<long long>(sq.q_begin + qi) * num_heads + h) * HEAD;
    if (sq.num_parts == 0) {
        for (int d = tid; d < HEAD; d += kThreads) o[d] = from_float<T>(0.f);
        return;
    }
    int p0 = 0, num_parts = sq.num_parts;
    if constexpr (MQ) {
        const int pos = sq.pos0 + qi;
        p0 = (window_lo(pos, sliding_window) - sq.start) / partition_size;
        num_parts = (pos - sq.start) / partition_size + 1 - p0;
    }
    float* w = reinterpret_cast<float*>(pg_smem);
    float* red = w + max_parts;
    const long long row = (decode_tmp_row<MQ>(b, sq.q_begin, max_query, qi) * num_heads + h) * max_parts + p0;

    float m = neg_inf();
    for (int i = tid; i < num_parts; i += kThreads) m = fmaxf(m, max_logits[row + i]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < kWarps; ++i) m = fmaxf(m, red[i]);
    __syncthreads();  // red is reused below

    float s = 0.f;
    for (int i = tid; i < num_parts; i += kThreads) {
        const float wi = exp_sums[row + i] * exp2f(max_logits[row + i] - m);
        w[i] = wi;
        s += wi;
    }
    s = warp_sum(s);
    if (lane == 0) red[warp] = s;
    __syncthreads();  // also publishes w
    s = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) s += red[i];
    const float inv = 1.f / s;
    for (int d = tid; d < HEAD; d += kThreads) {
        float acc = 0.f;
        for (int i = 0; i < num_parts; ++i) acc += w[i] * tmp_out[(row + i) * HEAD + d];
        o[d] = from_float<T>(acc * inv);
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill tile scheduling. A request with q_len > max_decode_query (the others are the decode
// kernel's) has q_len * G rows (row r = query r / G, head kh * G + r % G) cut into tiles of
// rows_per_tile; tiles are numbered request after request and CTA x takes tile x. The grid is an
// upper bound (ceil(T * G / rows) + B), so a CTA may find no tile and exits. Block-wide prefix
// sum over the requests, kThreads at a time.
// sched: 6 ints of shared memory. Returns false when there is no tile for this CTA.
__device__ __forceinline__ bool find_tile(const int* __restrict__ query_start_loc, int num_seqs,
                                          int max_decode_query, int G, int rows_per_tile, int* sched,
                                          int& b_out, int& tile_out)
{
    const int x = blockIdx.x;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (tid == 0) sched[0] = -1;
    int base = 0;  // tiles of requests before this chunk
    for (int c = 0; c < num_seqs; c += kThreads) {
        const int b = c + tid;
        int n = 0;
        if (b < num_seqs) {
            const int q_len = query_start_loc[b + 1] - query_start_loc[b];
            if (q_len > max_decode_query) n = (q_len * G + rows_per_tile - 1) / rows_per_tile;
        }
        int incl = n;  // inclusive scan within the warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(kFull, incl, o);
            if (lane >= o) incl += v;
        }
        __syncthreads();  // readers of the previous chunk's sums are done (and sched[0] = -1 seen)
        if (lane == 31) sched[2 + warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const int s = sched[2 + w];
            before += w < warp ? s : 0;
            total += s;
        }
        const int first = base + before + incl - n;
        if (n > 0 && x >= first && x < first + n) {  // exactly one thread matches
            sched[0] = b;
            sched[1] = x - first;
        }
        base += total;
        __syncthreads();
        if (sched[0] >= 0 || base > x) break;  // uniform: shared value read after a barrier
    }
    __syncthreads();  // also covers num_seqs == 0
    b_out = sched[0];
    tile_out = sched[1];
    return b_out >= 0;
}

// Rows [r0, r0 + rows) of the tile's request, keys [kv_begin, kv_end) visible to any of them.
struct TileRange {
    int b, q_begin, q_len, ctx, rows, r0, pos0, kv_begin, kv_end;
};
__device__ __forceinline__ TileRange tile_range(int b, int tile, int rows_per_tile, int G,
                                                const int* query_start_loc, const int* seq_lens,
                                                int sliding_window)
{
    TileRange r;
    r.b = b;
    r.q_begin = query_start_loc[b];
    r.q_len = query_start_loc[b + 1] - r.q_begin;
    r.ctx = seq_lens[b];
    r.rows = r.q_len * G;
    r.r0 = tile * rows_per_tile;
    const int r_last = imin(r.r0 + rows_per_tile, r.rows) - 1;
    r.pos0 = r.ctx - r.q_len;  // position of query 0
    r.kv_end = r.pos0 + r_last / G + 1;
    r.kv_begin = sliding_window > 0 ? imax(0, r.pos0 + r.r0 / G - sliding_window + 1) : 0;
    return r;
}

// ---------------------------------------------------------------------------------------------
// Varlen prefill with tensor cores (sm_80+, fp16/bf16), FlashAttention-2's scheme.
// grid: (ceil(T*G/BM) + B, KVH), block 128, BM = 64 * MT rows per CTA; each warp owns 16 * MT rows
// (MT m16 tiles, so every K/V fragment read from shared memory feeds MT mma). K/V tiles of BN keys
// go through shared memory with 16-byte cp.async (the next K tile loads while P.V runs, the next V
// tile while Q.K^T runs); a tile's slots are looked up once, into shared memory, for its K and V.
// S = Q K^T and O += P V with mma.m16n8k16 fed by ldmatrix (transposed for V); P stays in
// registers between the two (the S accumulators are P's A fragments); online softmax in base 2 with
// the row sums deferred to the end; the causal / window mask only on tiles that cross a row's
// visible range (warp-uniform test). Q stays in registers with 64-key tiles (MT == 1, or
// HEAD <= 64), or, for MT == 2 and HEAD > 64, in its own shared buffer, re-read per k-step, with
// 32-key tiles (FlashAttention-2's choices at d = 128: the registers go to the 32 x HEAD
// accumulator); HEAD 256 runs MT == 1 only, with Q in shared memory and 32-key tiles (its 16 x 256
// accumulator takes 128 registers a thread). Rows are padded by 8 elements, so the 8 rows one ldmatrix reads hit distinct banks.
// An fp8 cache (C): each 16-byte load brings 16 elements, widened to T (exactly: every e4m3 and
// e5m2 value is an fp16 and a bf16 value) and stored as two 16-byte chunks; synchronous loads, so
// they do not overlap the other GEMM as cp.async does.
// Dynamic smem: (Q_SMEM ? BM : 0) * SROW + 2 * BN * SROW elements (Q otherwise staged in the K and
// V buffers) + (8 + 2 * BN) ints; prefill_smem_bytes() in attention_ops.py computes the same.
template <typename T, int HEAD, int MT, typename C = T, bool CAP = false>
__global__ void __launch_bounds__(kThreads) paged_attention_prefill(
    T* __restrict__ out, const T* __restrict__ q, long long q_stride,
    const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int* __restrict__ block_tables, int block_table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
    int block_shift, int sliding_window, float scale_log2, int max_decode_query, float soft_cap_log2)
{
    static_assert(sizeof(T) == 2 && HEAD % 16 == 0, "mma prefill: 16-bit types, HEAD % 16 == 0");
    static_assert(MT == 1 || MT == 2, "mma prefill: 16 or 32 rows per warp");
    static_assert(MT == 1 || HEAD <= 128, "mma prefill: HEAD 256 takes 16 rows per warp");
    constexpr bool Q_SMEM = (MT == 2 && HEAD > 64) || HEAD > 128;
    constexpr int BN = Q_SMEM ? 32 : 64, BM = 64 * MT, WR = 16 * MT;
    constexpr int SROW = HEAD + 8;  // padded row: ldmatrix rows hit distinct banks
    constexpr int CH = HEAD / 8;    // 16-byte chunks per row
    static_assert(Q_SMEM || BM <= 2 * BN, "Q is staged in the K and V buffers");
    extern __shared__ __align__(16) unsigned char pg_smem[];
    T* sQ = reinterpret_cast<T*>(pg_smem);
    T* sK = sQ + (Q_SMEM ? BM * SROW : 0);
    T* sV = sK + BN * SROW;
    int* sched = reinterpret_cast<int*>(sV + BN * SROW);
    int* s_slot = sched + 8;  // [2][BN]: slots of the key tiles jt and jt + 1 (-1: past kv_end)

    const int G = num_heads / num_kv_heads;
    int b, tile;
    if (!find_tile(query_start_loc, num_seqs, max_decode_query, G, BM, sched, b, tile)) return;
    const TileRange tr = tile_range(b, tile, BM, G, query_start_loc, seq_lens, sliding_window);
    const int kh = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int* bt = block_tables + static_cast<long long>(b) * block_table_stride;
    const long long kv_row = static_cast<long long>(num_kv_heads) * HEAD;

    // Slots of the key tile at j0 into s_slot[buf] (published by the caller's next barrier).
    auto tile_slots = [&](int j0, int buf) {
        for (int i = tid; i < BN; i += kThreads)
            s_slot[buf * BN + i] = j0 + i < tr.kv_end ? static_cast<int>(slot_of(bt, j0 + i, block_shift)) : -1;
    };
    // This thread's 16-byte chunks of the K (or V) tile whose slots are in s_slot[buf].
    auto load_tile = [&](T* dst, const C* cache, int buf) {
        if constexpr (sizeof(C) == 1) {
            for (int c = tid; c < BN * (HEAD / 16); c += kThreads) {
                const int row = c / (HEAD / 16), part = c % (HEAD / 16);
                const int slot = s_slot[buf * BN + row];
                uint4 w{0u, 0u, 0u, 0u};  // keys past kv_end: zeros
                if (slot >= 0)
                    w = *reinterpret_cast<const uint4*>(cache + static_cast<long long>(slot) * kv_row +
                                                        kh * HEAD + part * 16);
                const unsigned u[4] = {w.x, w.y, w.z, w.w};
                unsigned h[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const unsigned bits = u[i / 2] >> (16 * (i % 2));
                    h[i] = pack2<T>(to_float(C{static_cast<unsigned char>(bits & 0xffu)}),
                                    to_float(C{static_cast<unsigned char>((bits >> 8) & 0xffu)}));
                }
                uint4* d = reinterpret_cast<uint4*>(dst + row * SROW + part * 16);
                d[0] = uint4{h[0], h[1], h[2], h[3]};
                d[1] = uint4{h[4], h[5], h[6], h[7]};
            }
        } else {
            for (int c = tid; c < BN * CH; c += kThreads) {
                const int row = c / CH, part = c % CH;
                const int slot = s_slot[buf * BN + row];
                const T* src = cache;
                int bytes = 0;
                if (slot >= 0) {
                    src = cache + static_cast<long long>(slot) * kv_row + kh * HEAD + part * 8;
                    bytes = 16;
                }
                cp_async16(dst + row * SROW + part * 8, src, bytes);  // keys past kv_end: zeros
            }
        }
    };

    // Q tile -> shared memory (its own buffer, or the K/V buffers: BM <= 2 * BN rows).
    tile_slots(tr.kv_begin, 0);
    T* sQ_stage = Q_SMEM ? sQ : sK;
    for (int c = tid; c < BM * CH; c += kThreads) {
        const int row = c / CH, part = c % CH;
        const int r = tr.r0 + row;
        const T* src = q;
        int bytes = 0;
        if (r < tr.rows) {
            src = q + static_cast<long long>(tr.q_begin + r / G) * q_stride +
                  static_cast<long long>(kh * G + r % G) * HEAD + part * 8;
            bytes = 16;
        }
        cp_async16(sQ_stage + row * SROW + part * 8, src, bytes);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int mi = lane / 8, mr = lane % 8;  // ldmatrix: this lane addresses row mr of matrix mi
    // A fragment of Q rows [warp * WR + mt * 16, +16), columns [ks * 16, +16).
    auto q_frag = [&](unsigned (&a)[4], int mt, int ks) {
        ldmatrix_x4(a, sQ_stage + (warp * WR + mt * 16 + mr + (mi & 1) * 8) * SROW + ks * 16 + (mi >> 1) * 8);
    };
    unsigned qf[Q_SMEM ? 1 : MT][Q_SMEM ? 1 : HEAD / 16][4];
    if constexpr (!Q_SMEM) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int ks = 0; ks < HEAD / 16; ++ks) q_frag(qf[mt][ks], mt, ks);
        __syncthreads();  // the K/V buffers are free again
    }

    // This thread's rows: warp * WR + mt * 16 + lane / 4 (+ 8). Invalid rows see no key. A tile is
    // unmasked for the warp when it lies inside every one of the warp's rows' visible ranges.
    int row_hi[MT][2], row_lo[MT][2];
    int warp_hi = 0x7fffffff, warp_lo = -0x7fffffff;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = tr.r0 + warp * WR + mt * 16 + lane / 4 + h * 8;
            row_hi[mt][h] = r < tr.rows ? tr.pos0 + r / G : -1;
            row_lo[mt][h] = sliding_window > 0 ? row_hi[mt][h] - sliding_window + 1 : 0;
            warp_hi = imin(warp_hi, row_hi[mt][h]);
            warp_lo = imax(warp_lo, row_lo[mt][h]);
        }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        warp_hi = imin(warp_hi, __shfl_xor_sync(kFull, warp_hi, off));
        warp_lo = imax(warp_lo, __shfl_xor_sync(kFull, warp_lo, off));
    }
    float o[MT][HEAD / 8][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < HEAD / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
        row_max[mt][0] = row_max[mt][1] = neg_inf();
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    const int num_tiles = (tr.kv_end - tr.kv_begin + BN - 1) / BN;
    load_tile(sK, k_cache, 0);  // s_slot[0] was published by the barriers after the Q load
    cp_async_commit();
    load_tile(sV, v_cache, 0);
    cp_async_commit();
    // cp.async groups are committed K0, V0, then K(j+1) and V(j+1) (possibly empty) per tile,
    // so "wait until at most one group is pending" always means the buffer about to be read.
    for (int jt = 0; jt < num_tiles; ++jt) {
        const int j0 = tr.kv_begin + jt * BN;
        const int next = (jt + 1) & 1;
        cp_async_wait<1>();
        __syncthreads();
        // s_slot[next] was last read by the loads of tile jt - 1, issued before the barrier above.
        if (jt + 1 < num_tiles) tile_slots(j0 + BN, next);
        float s[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HEAD / 16; ++ks) {
            unsigned qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (Q_SMEM) {
                    q_frag(qa[mt], mt, ks);
                } else {
#pragma unroll
                    for (int i = 0; i < 4; ++i) qa[mt][i] = qf[mt][ks][i];
                }
            }
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                unsigned kb[4];
                ldmatrix_x4(kb, sK + (np * 16 + mr + (mi >> 1) * 8) * SROW + ks * 16 + (mi & 1) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                    mma_16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with sK; s_slot[next] is published
        if (jt + 1 < num_tiles) load_tile(sK, k_cache, next);
        cp_async_commit();

        // Mask (only a tile crossing some row's range), then online softmax; a row's 4 owner lanes
        // (same lane / 4) agree on max and scale.
        const bool unmasked = j0 + BN - 1 <= warp_hi && j0 >= warp_lo;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = neg_inf();
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = j0 + nt * 8 + (lane % 4) * 2 + e;
                        float& v = s[mt][nt][h * 2 + e];
                        const bool seen = unmasked || (j <= row_hi[mt][h] && j >= row_lo[mt][h]);
                        v = seen ? soft_cap<CAP>(v * scale_log2, soft_cap_log2) : neg_inf();
                        mx = fmaxf(mx, v);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
                const float m_new = fmaxf(row_max[mt][h], mx);
                const float ref = m_new == neg_inf() ? 0.f : m_new;  // nothing seen yet: stay at 0
                const float alpha = exp2f(row_max[mt][h] - ref);
                row_max[mt][h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = exp2f(s[mt][nt][h * 2 + e] - ref);
                        s[mt][nt][h * 2 + e] = pv;
                        sum += pv;
                    }
                row_sum[mt][h] = row_sum[mt][h] * alpha + sum;  // this lane's columns; quad-summed at the end
#pragma unroll
                for (int dt = 0; dt < HEAD / 8; ++dt) {
                    o[mt][dt][h * 2] *= alpha;
                    o[mt][dt][h * 2 + 1] *= alpha;
                }
            }

        cp_async_wait<1>();
        __syncthreads();  // sV holds tile jt
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
            // The S accumulators of key tiles 2ks, 2ks+1 are exactly the A fragment of P.
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = pack2<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
                pa[mt][1] = pack2<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
                pa[mt][2] = pack2<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
                pa[mt][3] = pack2<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < HEAD / 16; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, sV + (ks * 16 + mr + (mi & 1) * 8) * SROW + dp * 16 + (mi >> 1) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                    mma_16816<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with sV
        if (jt + 1 < num_tiles) load_tile(sV, v_cache, next);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = row_sum[mt][h];
            sum += __shfl_xor_sync(kFull, sum, 1);
            sum += __shfl_xor_sync(kFull, sum, 2);
            const int r = tr.r0 + warp * WR + mt * 16 + lane / 4 + h * 8;
            if (r < tr.rows) {
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                T* dst = out + (static_cast<long long>(tr.q_begin + r / G) * num_heads + kh * G + r % G) * HEAD;
#pragma unroll
                for (int dt = 0; dt < HEAD / 8; ++dt) {  // two 16-bit outputs per 32-bit store
                    const int d = dt * 8 + (lane % 4) * 2;
                    *reinterpret_cast<unsigned*>(dst + d) =
                        pack2<T>(o[mt][dt][h * 2] * inv, o[mt][dt][h * 2 + 1] * inv);
                }
            }
        }
}

// ---------------------------------------------------------------------------------------------
// Varlen prefill without tensor cores: fp32 (exactness checks), fp16/bf16 before sm_80, and every
// type over an fp8 cache (C).
// grid: (ceil(T*G/16) + B, KVH), block 128. 16 rows per CTA, 4 per warp; keys in tiles of 32
// staged as floats; lane j scores key j of the tile, lane d accumulates output dims d, d+32, ...
// Dynamic smem (floats): q_s[16*HEAD] | k_s[32*(HEAD+1)] | v_s[32*(HEAD+1)] | 8 ints.
template <typename T, int HEAD, typename C = T, bool CAP = false>
__global__ void __launch_bounds__(kThreads) paged_attention_prefill_scalar(
    T* __restrict__ out, const T* __restrict__ q, long long q_stride,
    const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int* __restrict__ block_tables, int block_table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
    int block_shift, int sliding_window, float scale_log2, int max_decode_query, float soft_cap_log2)
{
    constexpr int BM = 16, BN = 32, RW = BM / kWarps;
    constexpr int KROW = HEAD + 1;           // odd stride: lane j reading row j is conflict-free
    constexpr int DL = (HEAD + 31) / 32;     // output dims per lane
    extern __shared__ __align__(16) unsigned char pg_smem[];
    float* q_s = reinterpret_cast<float*>(pg_smem);
    float* k_s = q_s + BM * HEAD;
    float* v_s = k_s + BN * KROW;
    int* sched = reinterpret_cast<int*>(v_s + BN * KROW);

    const int G = num_heads / num_kv_heads;
    int b, tile;
    if (!find_tile(query_start_loc, num_seqs, max_decode_query, G, BM, sched, b, tile)) return;
    const TileRange tr = tile_range(b, tile, BM, G, query_start_loc, seq_lens, sliding_window);
    const int kh = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int* bt = block_tables + static_cast<long long>(b) * block_table_stride;
    const long long kv_row = static_cast<long long>(num_kv_heads) * HEAD;

    for (int i = tid; i < BM * HEAD; i += kThreads) {
        const int r = tr.r0 + i / HEAD, d = i % HEAD;
        q_s[i] = r < tr.rows ? to_float(q[static_cast<long long>(tr.q_begin + r / G) * q_stride +
                                          static_cast<long long>(kh * G + r % G) * HEAD + d]) * scale_log2
                             : 0.f;
    }
    float m[RW], l[RW], acc[RW][DL];
#pragma unroll
    for (int rr = 0; rr < RW; ++rr) {
        m[rr] = neg_inf();
        l[rr] = 0.f;
#pragma unroll
        for (int k = 0; k < DL; ++k) acc[rr][k] = 0.f;
    }

    for (int j0 = tr.kv_begin; j0 < tr.kv_end; j0 += BN) {
        __syncthreads();  // previous tile fully consumed (and q_s written on the first pass)
        for (int i = tid; i < BN * HEAD; i += kThreads) {
            const int jr = i / HEAD, d = i % HEAD, j = j0 + jr;
            float kv = 0.f, vv = 0.f;
            if (j < tr.kv_end) {
                const long long off = slot_of(bt, j, block_shift) * kv_row + kh * HEAD + d;
                kv = to_float(k_cache[off]);
                vv = to_float(v_cache[off]);
            }
            k_s[jr * KROW + d] = kv;
            v_s[jr * KROW + d] = vv;
        }
        __syncthreads();
        const int j = j0 + lane;
#pragma unroll
        for (int rr = 0; rr < RW; ++rr) {
            const int lr = warp * RW + rr;
            const int r = tr.r0 + lr;
            if (r >= tr.rows) break;  // warp-uniform
            const int hi = tr.pos0 + r / G;
            const int lo = sliding_window > 0 ? hi - sliding_window + 1 : 0;
            float sc = 0.f;
#pragma unroll 8
            for (int d = 0; d < HEAD; ++d) sc += q_s[lr * HEAD + d] * k_s[lane * KROW + d];
            sc = (j <= hi && j >= lo) ? soft_cap<CAP>(sc, soft_cap_log2) : neg_inf();
            const float m_new = fmaxf(m[rr], warp_max(sc));
            const float ref = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = exp2f(m[rr] - ref);
            const float p = exp2f(sc - ref);
            l[rr] = l[rr] * alpha + warp_sum(p);
            m[rr] = m_new;
#pragma unroll
            for (int k = 0; k < DL; ++k) acc[rr][k] *= alpha;
            for (int jj = 0; jj < BN; ++jj) {
                const float pj = __shfl_sync(kFull, p, jj);
#pragma unroll
                for (int k = 0; k < DL; ++k) {
                    const int d = lane + 32 * k;
                    if (d < HEAD) acc[rr][k] += pj * v_s[jj * KROW + d];
                }
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < RW; ++rr) {
        const int r = tr.r0 + warp * RW + rr;
        if (r >= tr.rows) break;
        const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
        T* dst = out + (static_cast<long long>(tr.q_begin + r / G) * num_heads + kh * G + r % G) * HEAD;
#pragma unroll
        for (int k = 0; k < DL; ++k) {
            const int d = lane + 32 * k;
            if (d < HEAD) dst[d] = from_float<T>(acc[rr][k] * inv);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writes each token's K and V rows into slot slot_mapping[t] of an fp8 cache (C), converting from
// T. grid: (num_tokens), block: (min(row, 256) rounded up to a warp). key, value: [num_tokens,
// num_kv_heads, head_size], inner two dims contiguous, token stride in elements; row = num_kv_heads
// * head_size. A negative slot means "do not write" (padding tokens of a CUDA-graph batch).
template <typename T, typename C>
__global__ void __launch_bounds__(256) reshape_and_cache_fp8(
    const T* __restrict__ key, const T* __restrict__ value,
    C* __restrict__ key_cache, C* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping, long long key_stride, long long value_stride, int row)
{
    const long long t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    const T* ksrc = key + t * key_stride;
    const T* vsrc = value + t * value_stride;
    C* kdst = key_cache + slot * row;
    C* vdst = value_cache + slot * row;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        kdst[i] = from_float<C>(to_float(ksrc[i]));
        vdst[i] = from_float<C>(to_float(vsrc[i]));
    }
}

}  // namespace pagedrs
