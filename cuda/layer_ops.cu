#line 1 "cuda/layer_ops.cu"
// Fused elementwise layers: RMSNorm (alone, or with the residual add in place), rotary embedding (in
// place on q and k) and the gated activations of Llama-style MLPs. Each is one launch and one pass
// over its activations, where the torch path (layers/norm.py, rotary.py, activation.py) takes
// several kernels and as many passes.
//
// T = half_t, bf16_t or float. VEC = elements per access: 16 / sizeof(T) (16-byte vectors) when every
// row size, stride and base address allows it, else 1 (the Python wrappers choose).
// Rounding follows the torch path: statistics and products in fp32, each intermediate that torch
// rounds to T rounded here too, so 16-bit results agree with it to the bit except where an fp32 sum
// runs in another order (the norms' mean of squares), and float32 ones to the last bits.

#include "common.cuh"

namespace pagedrs {

template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

// x rounded to T and back (what a torch op in dtype T stores).
template <typename T> __device__ __forceinline__ float rounded(float x) {
    if constexpr (sizeof(T) == 4) {
        return x;
    } else {
        return to_float(from_float<T>(x));
    }
}

// Sum of x over the CTA (blockDim.x a multiple of 32); every thread gets it. red: 32 floats of
// shared memory, free again when this returns.
__device__ __forceinline__ float block_sum(float x, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = warp_sum(x);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    float s = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : 0.f;
    s = warp_sum(s);
    __syncthreads();
    return s;
}

// The second pass of both norms, over this thread's vectors of a row: dst = w * round(src * r).
template <typename T, int VEC>
__device__ __forceinline__ void write_normed(Pack<T, VEC>* dst, const Pack<T, VEC>* src,
                                             const Pack<T, VEC>* w, int nvec, float r) {
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        const Pack<T, VEC> x = src[i];
        const Pack<T, VEC> g = w[i];
        Pack<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            o.v[j] = from_float<T>(to_float(g.v[j]) * rounded<T>(to_float(x.v[j]) * r));
        dst[i] = o;
    }
}

// ---------------------------------------------------------------------------------------------
// out[t] = weight * round(x[t] * rsqrt(mean(x[t]^2) + eps)), as HF's LlamaRMSNorm.
// grid: (num_tokens), block: a multiple of 32 (<= 1024), dynamic smem 32 floats.
// x rows at x_stride elements; out contiguous [num_tokens, hidden]; hidden % VEC == 0.
template <typename T, int VEC>
__global__ void __launch_bounds__(1024) rms_norm(
    T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, long long x_stride,
    int hidden, float eps)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];
    using P = Pack<T, VEC>;
    const long long t = blockIdx.x;
    const P* xr = reinterpret_cast<const P*>(x + t * x_stride);
    const P* wr = reinterpret_cast<const P*>(weight);
    P* orow = reinterpret_cast<P*>(out + t * hidden);
    const int nvec = hidden / VEC;
    float ss = 0.f;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        const P p = xr[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float f = to_float(p.v[j]);
            ss += f * f;
        }
    }
    const float r = rsqrtf(block_sum(ss, reinterpret_cast<float*>(pg_smem)) / hidden + eps);
    write_normed(orow, xr, wr, nvec, r);
}

// In place: residual[t] = round(x[t] + residual[t]); x[t] = rms_norm(residual[t]) (vLLM's
// fused_add_rms_norm). Same launch shape as rms_norm; rows at x_stride / res_stride elements.
// Each thread rereads, in the second pass, only the residual elements it wrote in the first.
template <typename T, int VEC>
__global__ void __launch_bounds__(1024) fused_add_rms_norm(
    T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight, long long x_stride,
    long long res_stride, int hidden, float eps)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];
    using P = Pack<T, VEC>;
    const long long t = blockIdx.x;
    P* xr = reinterpret_cast<P*>(x + t * x_stride);
    P* rr = reinterpret_cast<P*>(residual + t * res_stride);
    const P* wr = reinterpret_cast<const P*>(weight);
    const int nvec = hidden / VEC;
    float ss = 0.f;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        const P a = xr[i];
        P z = rr[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            z.v[j] = from_float<T>(to_float(a.v[j]) + to_float(z.v[j]));
            const float f = to_float(z.v[j]);
            ss += f * f;
        }
        rr[i] = z;
    }
    const float r = rsqrtf(block_sum(ss, reinterpret_cast<float*>(pg_smem)) / hidden + eps);
    write_normed(xr, rr, wr, nvec, r);
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding in place on q [T, num_heads * head_size] and k [T, num_kv_heads * head_size]
// (rows at q_stride / k_stride elements: views of a fused qkv output are fine). The first rot_dim
// dims of each head rotate (partial rotary leaves the rest); NEOX pairs dim j with j + rot_dim/2
// (rotate halves), otherwise (GPT-J) 2j with 2j+1. cache: float32 [max_position, rot_dim], cos of
// pair j at j and sin at rot_dim/2 + j, scalings (linear, llama3, longrope's attention factor)
// already applied. long_cache (longrope) replaces it for a token whose request is longer than
// long_threshold (seq_lens[t]); null when unused. grid: (num_tokens), block: a multiple of 32.
template <typename T, bool NEOX>
__global__ void __launch_bounds__(512) rotary_embedding(
    T* __restrict__ q, T* __restrict__ k, const long long* __restrict__ positions,
    const float* __restrict__ cache, const float* __restrict__ long_cache,
    const long long* __restrict__ seq_lens, long long long_threshold, long long q_stride,
    long long k_stride,
    int num_heads, int num_kv_heads, int head_size, int rot_dim)
{
    const long long t = blockIdx.x;
    const float* cs = long_cache != nullptr && seq_lens[t] > long_threshold ? long_cache : cache;
    cs += positions[t] * rot_dim;
    const int half = rot_dim / 2;
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int head = i / half, j = i - head * half;
        T* base = head < num_heads ? q + t * q_stride + head * head_size
                                   : k + t * k_stride + (head - num_heads) * head_size;
        const int i0 = NEOX ? j : 2 * j;
        const int i1 = NEOX ? j + half : 2 * j + 1;
        // As the torch path (and HF): cos/sin rounded to T, each product and the sum rounded to T.
        const float c = rounded<T>(cs[j]), s = rounded<T>(cs[half + j]);
        const float x0 = to_float(base[i0]), x1 = to_float(base[i1]);
        base[i0] = from_float<T>(rounded<T>(x0 * c) - rounded<T>(x1 * s));
        base[i1] = from_float<T>(rounded<T>(x1 * c) + rounded<T>(x0 * s));
    }
}

// ---------------------------------------------------------------------------------------------
// Gated activations: x [T, 2d] = [gate | up] (rows at x_stride elements) -> out [T, d] contiguous,
// out = round(round(act(gate)) * up). ACT: 0 SiLU, 1 exact GELU (erf), 2 GELU tanh approximation.
// grid: (num_tokens, column blocks), block: a multiple of 32; d % VEC == 0.
template <int ACT> __device__ __forceinline__ float activation(float g) {
    if constexpr (ACT == 0) {
        return g / (1.f + expf(-g));
    } else if constexpr (ACT == 1) {
        return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
    } else {
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.f + tanhf(inner));
    }
}

template <typename T, int VEC, int ACT>
__global__ void __launch_bounds__(1024) act_and_mul(
    T* __restrict__ out, const T* __restrict__ x, long long x_stride, int d)
{
    using P = Pack<T, VEC>;
    const long long t = blockIdx.x;
    const P* gate = reinterpret_cast<const P*>(x + t * x_stride);
    const P* up = reinterpret_cast<const P*>(x + t * x_stride + d);
    P* orow = reinterpret_cast<P*>(out + t * d);
    const int nvec = d / VEC;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < nvec; i += gridDim.y * blockDim.x) {
        const P g = gate[i];
        const P u = up[i];
        P o;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            o.v[j] = from_float<T>(rounded<T>(activation<ACT>(to_float(g.v[j]))) * to_float(u.v[j]));
        orow[i] = o;
    }
}

}  // namespace pagedrs
