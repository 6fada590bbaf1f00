/*
 * cuda_on_host.h: just enough of CUDA's device-side language for libserve's kernels to compile
 * and run on the CPU with a host C++20 compiler (ARCHITECTURE.md §9, "GPU code verified on the
 * host"). Included before the kernels by kernels_on_host.cpp; never used by nvcc or NVRTC.
 *
 * A launch runs a grid block after block. Within a block the threads run one of two ways:
 * - sequentially, one thread's whole body after the other, for kernels whose threads never
 *   meet (no __syncthreads, no warp shuffles: every kernel but serve_argmax). Each thread sees
 *   its own threadIdx / blockIdx; addresses, arithmetic and bounds are exactly the kernel's.
 * - cooperatively, for kernels that synchronise: blockDim real threads, each running the kernel
 *   over every block in turn, with __syncthreads a barrier of the block and __shfl_down_sync an
 *   exchange between the 32 threads of a warp (every lane writes its value, the warp meets at a
 *   barrier, every lane reads its partner's, the warp meets again). __shared__ variables are
 *   function statics: one copy, used by one block at a time, as a block's shared memory is (so
 *   the launcher runs one cooperative launch at a time in the process).
 * Calling __syncthreads or a shuffle in a sequential launch is a bug in the launch table: it
 * stops the process with a message.
 */
#ifndef SERVE_CUDA_ON_HOST_H
#define SERVE_CUDA_ON_HOST_H

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#define SERVE_HOST_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct dim3 {
    uint32_t x = 1, y = 1, z = 1;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

/* The calling thread's place in the launch. */
inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace serve_host {

/* What the threads of one cooperative block share. */
struct Block {
    explicit Block(uint32_t threads) : all(threads) {
        for (uint32_t w = 0; w < (threads + 31) / 32; ++w) {
            const uint32_t lanes = threads - 32 * w < 32 ? threads - 32 * w : 32;
            warps.push_back(std::make_unique<Warp>(lanes));
        }
    }
    struct Warp {
        explicit Warp(uint32_t lanes) : meet(lanes) {}
        std::barrier<> meet;
        uint64_t value[32] = {};
    };
    std::barrier<> all;
    std::vector<std::unique_ptr<Warp>> warps;
};

/* The calling thread's block in a cooperative launch; null in a sequential one. */
inline thread_local Block *block = nullptr;

[[noreturn]] inline void not_cooperative(const char *what) {
    std::fprintf(stderr, "cuda_on_host: %s in a kernel launched sequentially (mark it cooperative)\n", what);
    std::abort();
}

}  // namespace serve_host

inline void __syncthreads() {
    if (serve_host::block == nullptr) {
        serve_host::not_cooperative("__syncthreads");
    }
    serve_host::block->all.arrive_and_wait();
}

/* The value of lane (lane + delta) of the warp, or the caller's own when that lane is past the
 * warp's end. Every lane of the warp must call it (mask 0xFFFFFFFF, as the kernels use). */
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffled value fits 64 bits");
    (void)mask;
    if (serve_host::block == nullptr) {
        serve_host::not_cooperative("__shfl_down_sync");
    }
    auto &warp = *serve_host::block->warps[threadIdx.x / 32];
    const uint32_t lane = threadIdx.x % 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    warp.value[lane] = bits;
    warp.meet.arrive_and_wait();
    T out = v;
    if (lane + delta < 32 && threadIdx.x + delta < blockDim.x) {
        std::memcpy(&out, &warp.value[lane + delta], sizeof(T));
    }
    warp.meet.arrive_and_wait();
    return out;
}

inline float __uint_as_float(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

#endif /* SERVE_CUDA_ON_HOST_H */
