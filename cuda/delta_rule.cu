#line 1 "cuda/delta_rule.cu"
// The decode step of a Gated DeltaNet (linear-attention) layer, one token per sequence, in place on each
// sequence's state slot, as the torch path (pagedrs.layers.delta_rule: causal_conv1d_update then
// recurrent_gated_delta_rule) and HF transformers' torch fallbacks compute it. Two launches per layer:
//
//   gdn_conv_update: mixed[row, c] = silu(sum_j w[c, j] * window[j]), window = the slot's last K - 1
//     inputs of channel c then qkv[row, c]; the slot's window shifts by one (float32 [slots, C, K - 1]).
//   gdn_recurrent: per value head h of each row, with q/k of its key head (h / (Hv / Hk)) L2-normalised
//     (q also scaled by Dk^-0.5), g = -exp(A_log[h]) * softplus(a[row, h] + dt_bias[h]) and
//     beta = sigmoid(b[row, h]) (rounded to T, as torch's sigmoid in the activations' dtype):
//       S = S * exp(g);  S += k (beta (v - S^T k))^T;  out[row, h] = S^T q
//     on the slot's state S [Dk, Dv] (float32 [slots, Hv, Dk, Dv]).
//
// T = half_t, bf16_t or float for the activations and weights; the conv output, states and sums are fp32,
// out is rounded to T once. A slot index below 0 skips the row (its output is left alone).

#include "common.cuh"

namespace pagedrs {

__device__ __forceinline__ float gdn_silu(float x) { return x / (1.f + expf(-x)); }

// grid: (rows, ceil(C / blockDim.x)); one thread per channel. qkv rows at qkv_stride elements; conv_w
// [C, K] contiguous; mixed float32 [rows, C].
template <typename T>
__global__ void __launch_bounds__(128) gdn_conv_update(
    float* __restrict__ mixed, float* __restrict__ conv_state, const T* __restrict__ qkv,
    const T* __restrict__ conv_w, const int* __restrict__ slots, long long qkv_stride, int channels,
    int kernel)
{
    const long long row = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    const int slot = slots[row];
    if (c >= channels || slot < 0) return;
    float* window = conv_state + (static_cast<long long>(slot) * channels + c) * (kernel - 1);
    const T* w = conv_w + static_cast<long long>(c) * kernel;
    const float x = to_float(qkv[row * qkv_stride + c]);
    float acc = 0.f;
    for (int j = 0; j < kernel - 1; ++j) acc += to_float(w[j]) * window[j];
    acc += to_float(w[kernel - 1]) * x;
    for (int j = 0; j + 1 < kernel - 1; ++j) window[j] = window[j + 1];
    if (kernel > 1) window[kernel - 2] = x;
    mixed[row * channels + c] = gdn_silu(acc);
}

// The sum of `x` over the CTA (blockDim.x a multiple of 32, <= 1024), in every thread.
__device__ __forceinline__ float gdn_block_sum(float x, float* scratch) {
    x = warp_sum(x);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(x);
}

// grid: (rows, Hv); dynamic shared memory (2 * Dk + 32) floats; block: a multiple of 32 threads, each owning state columns j = threadIdx.x + n *
// blockDim.x. mixed float32 [rows, 2 * Hk * Dk + Hv * Dv] (q, k, v as the conv left them); a, b rows at
// ab_stride elements; out [rows, Hv * Dv] contiguous.
template <typename T>
__global__ void __launch_bounds__(128) gdn_recurrent(
    T* __restrict__ out, float* __restrict__ ssm, const float* __restrict__ mixed,
    const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ dt_bias,
    const T* __restrict__ a_log, const int* __restrict__ slots, long long ab_stride, int num_k_heads,
    int num_v_heads, int dk, int dv)
{
    extern __shared__ __align__(16) unsigned char pg_smem[];  // (2 * dk + 32) floats
    float* qs = reinterpret_cast<float*>(pg_smem);
    float* ks = qs + dk;
    float* scratch = ks + dk;
    const long long row = blockIdx.x;
    const int h = blockIdx.y;
    const int slot = slots[row];
    if (slot < 0) return;  // the whole CTA: no barrier was reached
    const int kh = h / (num_v_heads / num_k_heads);
    const int key_dim = num_k_heads * dk;
    const long long width = 2LL * key_dim + static_cast<long long>(num_v_heads) * dv;
    const float* m = mixed + row * width;
    float sq = 0.f, sk = 0.f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float q = m[kh * dk + i], k = m[key_dim + kh * dk + i];
        qs[i] = q;
        ks[i] = k;
        sq += q * q;
        sk += k * k;
    }
    sq = gdn_block_sum(sq, scratch);
    sk = gdn_block_sum(sk, scratch);
    const float q_scale = rsqrtf(sq + 1e-6f) * rsqrtf(static_cast<float>(dk));
    const float k_scale = rsqrtf(sk + 1e-6f);
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        qs[i] *= q_scale;
        ks[i] *= k_scale;
    }
    __syncthreads();
    const float x = to_float(a[row * ab_stride + h]) + to_float(dt_bias[h]);
    const float softplus = x > 20.f ? x : log1pf(expf(x));  // torch's softplus threshold
    const float decay = expf(-expf(to_float(a_log[h])) * softplus);
    const float beta = to_float(from_float<T>(1.f / (1.f + expf(-to_float(b[row * ab_stride + h])))));
    float* s = ssm + (static_cast<long long>(slot) * num_v_heads + h) * dk * dv;
    const float* v = m + 2LL * key_dim + static_cast<long long>(h) * dv;
    T* o = out + row * (static_cast<long long>(num_v_heads) * dv) + static_cast<long long>(h) * dv;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
        float kv = 0.f;
        for (int i = 0; i < dk; ++i) kv += s[i * dv + j] * decay * ks[i];
        const float delta = (v[j] - kv) * beta;
        float acc = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float next = s[i * dv + j] * decay + ks[i] * delta;
            s[i * dv + j] = next;
            acc += next * qs[i];
        }
        o[j] = from_float<T>(acc);
    }
}

}  // namespace pagedrs
