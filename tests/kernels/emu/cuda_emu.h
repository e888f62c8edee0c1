// A host emulator for the kernels in cuda/, so their indexing and numerics are tested on a CPU.
//
// Each CTA's threads run as coroutines (ucontext) on one OS thread; CTAs run one after another.
// __syncthreads is a barrier of every thread of the CTA, each warp-level primitive (shuffles,
// ldmatrix, mma) a barrier of the 32 lanes of the warp, so a primitive that a lane skips or a
// barrier that a thread misses (it returned early) deadlocks, which is reported as an error
// instead of silently computing. Shared memory is refilled with NaN bytes before every CTA, so
// reading what was never written shows up in the results.
//
// The PTX-level helpers (cp.async, ldmatrix, mma.m16n8k16, f16 conversions) follow the fragment
// layouts of the PTX ISA; cuda/paged_attention.cu uses them instead of inline asm when built
// with PAGEDRS_EMU.
#pragma once

#include <math.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace pagedrs {
template <typename T> struct is_bf16;  // defined by cuda/paged_attention.cu
}

namespace emu {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kSlotBytes = 64;  // one lane's payload in a warp exchange
constexpr size_t kSmemBytes = 1 << 20;

enum class State { Runnable, Blocked, Done };

struct Barrier {
    int expected = 0;
    int count = 0;
};

struct Thread {
    ucontext_t ctx;
    State state = State::Runnable;
    Barrier* waiting = nullptr;
    unsigned collectives = 0;  // warp primitives called so far (selects the exchange buffer)
};

struct Cta {
    int nthreads = 0;
    int cur = 0;
    std::vector<Thread> threads;
    std::vector<std::vector<char>> stacks;
    ucontext_t sched;
    Barrier block_barrier;
    std::vector<Barrier> warp_barriers;
    std::vector<unsigned char> exchange;  // [warp][parity][lane][kSlotBytes]
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
};

inline Cta g_cta;

inline void set_thread_index(int t) {
    threadIdx.x = t % blockDim.x;
    threadIdx.y = (t / blockDim.x) % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
}

inline void barrier_wait(Barrier& b) {
    Cta& c = g_cta;
    if (++b.count == b.expected) {  // last to arrive: release the others, keep running
        b.count = 0;
        for (Thread& t : c.threads)
            if (t.state == State::Blocked && t.waiting == &b) {
                t.state = State::Runnable;
                t.waiting = nullptr;
            }
        return;
    }
    Thread& me = c.threads[c.cur];
    me.state = State::Blocked;
    me.waiting = &b;
    swapcontext(&me.ctx, &c.sched);
}

inline void thread_entry(int t) {
    g_cta.body(g_cta.body_arg);
    g_cta.threads[t].state = State::Done;
}  // returns to uc_link = the scheduler

// Runs one CTA (blockIdx already set) to completion.
inline void run_cta(void (*body)(void*), void* arg) {
    Cta& c = g_cta;
    const int n = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
    if (n % 32 != 0) throw std::runtime_error("emulator: block size must be a multiple of 32");
    c.nthreads = n;
    c.body = body;
    c.body_arg = arg;
    c.threads.assign(n, Thread{});
    if (c.stacks.size() < static_cast<size_t>(n)) c.stacks.resize(n);
    c.block_barrier = Barrier{n, 0};
    c.warp_barriers.assign(n / 32, Barrier{32, 0});
    c.exchange.assign(static_cast<size_t>(n / 32) * 2 * 32 * kSlotBytes, 0);
    for (int t = 0; t < n; ++t) {
        if (c.stacks[t].empty()) c.stacks[t].resize(kStackBytes);
        getcontext(&c.threads[t].ctx);
        c.threads[t].ctx.uc_stack.ss_sp = c.stacks[t].data();
        c.threads[t].ctx.uc_stack.ss_size = kStackBytes;
        c.threads[t].ctx.uc_link = &c.sched;
        makecontext(&c.threads[t].ctx, reinterpret_cast<void (*)()>(thread_entry), 1, t);
    }
    for (;;) {
        bool ran = false, all_done = true;
        for (int t = 0; t < n; ++t) {
            if (c.threads[t].state == State::Done) continue;
            all_done = false;
            if (c.threads[t].state != State::Runnable) continue;
            c.cur = t;
            set_thread_index(t);
            swapcontext(&c.sched, &c.threads[t].ctx);
            ran = true;
        }
        if (all_done) return;
        if (!ran) {
            int blocked_block = 0, blocked_warp = 0, done = 0;
            for (const Thread& t : c.threads) {
                if (t.state == State::Done) ++done;
                else if (t.waiting == &c.block_barrier) ++blocked_block;
                else ++blocked_warp;
            }
            throw std::runtime_error(
                "emulator: deadlock in CTA (" + std::to_string(blockIdx.x) + "," +
                std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + "): " +
                std::to_string(done) + " threads returned, " + std::to_string(blocked_block) +
                " at __syncthreads, " + std::to_string(blocked_warp) + " at a warp primitive");
        }
    }
}

// ---- warp exchange: every lane publishes a payload, then reads any lane's ----------------------
struct Exchange {
    int warp, parity;
    const unsigned char* at(int lane) const {
        return &g_cta.exchange[((static_cast<size_t>(warp) * 2 + parity) * 32 + lane) * kSlotBytes];
    }
};

// Two buffers used alternately need one barrier per primitive: a lane can only overwrite buffer p
// after the next primitive's barrier, which every lane reaches after reading p.
template <typename V> inline Exchange publish(const V& v) {
    static_assert(sizeof(V) <= kSlotBytes, "payload too large");
    Cta& c = g_cta;
    const int t = c.cur, warp = t / 32, lane = t % 32;
    const int parity = static_cast<int>(c.threads[t].collectives++ & 1u);
    std::memcpy(&c.exchange[((static_cast<size_t>(warp) * 2 + parity) * 32 + lane) * kSlotBytes], &v,
                sizeof(V));
    barrier_wait(c.warp_barriers[warp]);
    return Exchange{warp, parity};
}
template <typename V> inline V read(const Exchange& x, int lane) {
    V v;
    std::memcpy(&v, x.at(lane), sizeof(V));
    return v;
}
inline int lane_id() { return g_cta.cur % 32; }

// ---- numeric helpers -----------------------------------------------------------------------------
inline float half_to_float(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
inline unsigned short float_to_half(float f) {
    const _Float16 h = static_cast<_Float16>(f);
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
inline float bf16_to_float(unsigned short bits) {
    const unsigned u = static_cast<unsigned>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// ---- PTX-level helpers ---------------------------------------------------------------------------
inline void cp_async16(void* smem, const void* gmem, int bytes) {
    if (bytes > 0) std::memcpy(smem, gmem, bytes);
    std::memset(static_cast<char*>(smem) + bytes, 0, 16 - bytes);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i; lane l receives, of each
// matrix, row l/4, 16-bit columns 2(l%4) and 2(l%4)+1 (transposed: rows 2(l%4), 2(l%4)+1 of
// column l/4).
inline void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    const Exchange x = publish(p);
    const int lane = lane_id();
    for (int i = 0; i < 4; ++i) {
        const char* row = static_cast<const char*>(read<const void*>(x, 8 * i + lane / 4));
        std::memcpy(&r[i], row + (lane % 4) * 4, 4);
    }
}
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    const Exchange x = publish(p);
    const int lane = lane_id();
    for (int i = 0; i < 4; ++i) {
        unsigned short v[2];
        for (int e = 0; e < 2; ++e) {
            const char* row = static_cast<const char*>(read<const void*>(x, 8 * i + (lane % 4) * 2 + e));
            std::memcpy(&v[e], row + (lane / 4) * 2, 2);
        }
        r[i] = static_cast<unsigned>(v[0]) | (static_cast<unsigned>(v[1]) << 16);
    }
}

struct MmaOperands {
    unsigned a[4];
    unsigned b[2];
};

// mma.sync.m16n8k16.row.col, fp32 accumulate. Fragments (g = lane / 4, c = lane % 4):
// A reg i: row g + 8 * (i & 1), cols 2c + 8 * (i >> 1) (+0, +1); B reg i: rows 2c + 8i (+0, +1),
// col g; C/D: d0, d1 at (g, 2c), (g, 2c + 1); d2, d3 at (g + 8, 2c), (g + 8, 2c + 1).
template <typename T>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    MmaOperands mine;
    std::memcpy(mine.a, a, sizeof(mine.a));
    mine.b[0] = b0;
    mine.b[1] = b1;
    const Exchange x = publish(mine);
    const int lane = lane_id(), g = lane / 4, c = lane % 4;
    auto elem = [](unsigned reg, int half) {
        const unsigned short bits = static_cast<unsigned short>(half ? reg >> 16 : reg & 0xffffu);
        return pagedrs::is_bf16<T>::value ? bf16_to_float(bits) : half_to_float(bits);
    };
    auto A = [&](int row, int k) {
        const int owner = (row % 8) * 4 + (k % 8) / 2;
        const int reg = (row / 8) + 2 * (k / 8);
        return elem(read<MmaOperands>(x, owner).a[reg], k % 2);
    };
    auto B = [&](int k, int col) {
        const int owner = col * 4 + (k % 8) / 2;
        return elem(read<MmaOperands>(x, owner).b[k / 8], k % 2);
    };
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * c + (i % 2);
        float acc = d[i];
        for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        d[i] = acc;
    }
}

}  // namespace emu

// ---- CUDA built-ins ------------------------------------------------------------------------------
inline void __syncthreads() { emu::barrier_wait(emu::g_cta.block_barrier); }
[[noreturn]] inline void __trap() { std::abort(); }

template <typename V> inline V __shfl_xor_sync(unsigned, V v, int mask, int width = 32) {
    const emu::Exchange x = emu::publish(v);
    const int lane = emu::lane_id();
    const int src = (lane ^ mask) < ((lane / width) + 1) * width ? lane ^ mask : lane;
    return emu::read<V>(x, src);
}
template <typename V> inline V __shfl_up_sync(unsigned, V v, unsigned delta, int width = 32) {
    const emu::Exchange x = emu::publish(v);
    const int lane = emu::lane_id();
    const int src = (lane % width) >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
    return emu::read<V>(x, src);
}
template <typename V> inline V __shfl_sync(unsigned, V v, int src_lane, int width = 32) {
    const emu::Exchange x = emu::publish(v);
    const int lane = emu::lane_id();
    return emu::read<V>(x, (lane & ~(width - 1)) | (src_lane & (width - 1)));
}

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

namespace pagedrs {
alignas(16) inline unsigned char pg_smem[emu::kSmemBytes];
}
