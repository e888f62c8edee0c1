#line 1 "cuda/common.cuh"
// What every kernel file shares: the 16-bit and fp8 storage types and their conversions (valid on
// every architecture), the PTX-level helpers (cp.async, ldmatrix, mma.m16n8k16) and warp reductions.
//
// Header-free itself (no CUDA include), so NVRTC needs no include directory: kernel_source() inlines
// this file where a .cu file includes it. PAGEDRS_EMU builds it as host C++ for the CPU emulator in
// tests/kernels/emu, which supplies the PTX-level helpers.
#pragma once

namespace pagedrs {

struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };
struct fp8e4m3_t { unsigned char bits; };
struct fp8e5m2_t { unsigned char bits; };
template <typename T> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<bf16_t> { static constexpr bool value = true; };

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    // round to nearest even, like cvt.rn.bf16.f32, but valid on every architecture
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<unsigned short>(0x7fc0)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16_t{static_cast<unsigned short>(u >> 16)};
}

// fp8 <-> fp32 in integer arithmetic (valid on every architecture, and in the emulator).
// e4m3: bias 7, no infinities, 0x7f/0xff NaN, largest finite 448 (0x7e). e5m2: bias 15, IEEE-like.
__device__ __forceinline__ float to_float(fp8e4m3_t x) {
    const unsigned sign = static_cast<unsigned>(x.bits & 0x80u) << 24;
    const unsigned e = (x.bits >> 3) & 0xfu, m = x.bits & 0x7u;
    if (e == 0) {  // zero and subnormals: m * 2^-9
        const float f = static_cast<float>(m) * 0.001953125f;
        return __uint_as_float(__float_as_uint(f) | sign);
    }
    if (e == 0xfu && m == 0x7u) return __uint_as_float(0x7fc00000u | sign);
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}
__device__ __forceinline__ float to_float(fp8e5m2_t x) {
    const unsigned sign = static_cast<unsigned>(x.bits & 0x80u) << 24;
    const unsigned e = (x.bits >> 2) & 0x1fu, m = x.bits & 0x3u;
    if (e == 0) {  // zero and subnormals: m * 2^-16
        const float f = static_cast<float>(m) * 1.52587890625e-05f;
        return __uint_as_float(__float_as_uint(f) | sign);
    }
    if (e == 0x1fu) return __uint_as_float(sign | (m ? 0x7fc00000u : 0x7f800000u));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 21));
}
// x rounded to MBITS mantissa bits (round to nearest even) as an fp8 code with exponent bias BIAS,
// subnormals below 2^(1 - BIAS), saturated at MAXCODE; NaN -> NANCODE.
template <int MBITS, int BIAS, unsigned MAXCODE, unsigned NANCODE>
__device__ __forceinline__ unsigned char fp8_code(float x) {
    const unsigned u = __float_as_uint(x);
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<unsigned char>(NANCODE | sign);
    constexpr unsigned shift = 23 - MBITS;
    unsigned code;
    if (a < static_cast<unsigned>(128 - BIAS) << 23) {  // subnormal: a multiple of 2^(1 - BIAS - MBITS)
        const float unit = __uint_as_float(static_cast<unsigned>(128 - BIAS - MBITS) << 23);
        code = static_cast<unsigned>(rintf(__uint_as_float(a) / unit));  // exact scaling, RNE
    } else {
        const unsigned r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
        code = r - (static_cast<unsigned>(127 - BIAS) << MBITS);
    }
    if (code > MAXCODE) code = MAXCODE;
    return static_cast<unsigned char>(code | sign);
}
template <> __device__ __forceinline__ fp8e4m3_t from_float<fp8e4m3_t>(float x) {
    return fp8e4m3_t{fp8_code<3, 7, 0x7eu, 0x7fu>(x)};
}
template <> __device__ __forceinline__ fp8e5m2_t from_float<fp8e5m2_t>(float x) {
    return fp8e5m2_t{fp8_code<2, 15, 0x7bu, 0x7fu>(x)};
}

#ifdef PAGEDRS_EMU
__device__ __forceinline__ float to_float(half_t x) { return emu::half_to_float(x.bits); }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
    return half_t{emu::float_to_half(x)};
}
using emu::cp_async16;
using emu::cp_async_commit;
using emu::cp_async_wait;
using emu::ldmatrix_x4;
using emu::ldmatrix_x4_trans;
using emu::mma_16816;
#else
__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return half_t{h};
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16-byte global -> shared copy; bytes < 16 zero-fills the rest (bytes = 0: pure zero fill).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(smem)), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(smem)));
}
// d += a (16x16, row) * b (16x8, col), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (is_bf16<T>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    __trap();  // the loader only picks the mma kernel on sm_80 and newer
#endif
}
#endif  // PAGEDRS_EMU

// Two floats -> one 32-bit register of two 16-bit values, lo in the low half (lower k index).
// Round to nearest even either way; sm_80+ converts the pair in one instruction.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if !defined(PAGEDRS_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned r;
    if constexpr (is_bf16<T>::value) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
#else
    return static_cast<unsigned>(from_float<T>(lo).bits) |
           (static_cast<unsigned>(from_float<T>(hi).bits) << 16);
#endif
}

// Loads BYTES (8 or 16) bytes at p, which is BYTES-aligned, as floats.
template <typename T, int BYTES>
__device__ __forceinline__ void load_floats(const T* p, float* out) {
    unsigned u[BYTES / 4];
    if constexpr (BYTES == 16) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        u[0] = w.x; u[1] = w.y; u[2] = w.z; u[3] = w.w;
    } else {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        u[0] = w.x; u[1] = w.y;
    }
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) {
        if constexpr (sizeof(T) == 4) {
            out[i] = __uint_as_float(u[i]);
        } else if constexpr (sizeof(T) == 1) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                out[4 * i + j] = to_float(T{static_cast<unsigned char>((u[i] >> (8 * j)) & 0xffu)});
        } else {
            out[2 * i] = to_float(T{static_cast<unsigned short>(u[i] & 0xffffu)});
            out[2 * i + 1] = to_float(T{static_cast<unsigned short>(u[i] >> 16)});
        }
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
    return x;
}

}  // namespace pagedrs
