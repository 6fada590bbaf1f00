/*
 * kernels_on_host.cpp: libserve's CUDA kernels (the .cu files of cuda/) compiled for the CPU with the
 * device-language shim of cuda_on_host.h, and one C entry point that launches any of them on a
 * host grid (ARCHITECTURE.md §9). The tests build it into a shared library and compare every
 * kernel with the CPU backend on the same inputs, so each kernel's per-thread arithmetic and
 * indexing is checked by `cargo test` on a machine with no GPU (tests/common/cuda_kernels.rs).
 *
 * Addresses in the parameter structs are host addresses: serve_dptr is 64 bits, and a host
 * pointer is what the kernels' serve_ptr<T>() turns it back into.
 *
 * Build: c++ -std=c++20 -shared -fPIC -pthread cuda/host/kernels_on_host.cpp
 */
#include "cuda_on_host.h"

#include <cstring>
#include <mutex>
#include <thread>

#include "../serve_device.cuh"
#include "../signal.cu"
#include "../embedding.cu"
#include "../lstm.cu"
#include "../dense.cu"
#include "../layers.cu"

namespace {

/* Run kernel `k` over `grid` blocks of `block` threads, as the header's comment says. */
template <typename P>
void run(void (*k)(P), bool cooperative, uint32_t grid, uint32_t block, const void *params) {
    P p;
    std::memcpy(&p, params, sizeof p);
    const dim3 g{grid, 1, 1};
    const dim3 b{block, 1, 1};
    if (!cooperative) {
        gridDim = g;
        blockDim = b;
        for (uint32_t bx = 0; bx < grid; ++bx) {
            blockIdx = dim3{bx, 0, 0};
            for (uint32_t tx = 0; tx < block; ++tx) {
                threadIdx = dim3{tx, 0, 0};
                k(p);
            }
        }
        return;
    }
    /* The kernels' block reductions assume whole warps (SERVE_BLOCK is one): a launch with a
     * partial warp would give a wrong answer on a GPU too. */
    if (block % 32 != 0) {
        std::fprintf(stderr, "kernels_on_host: a cooperative launch of %u threads per block (not whole warps)\n", block);
        std::abort();
    }
    /* __shared__ variables are statics: one cooperative launch at a time in the process, as
     * test threads may launch concurrently. */
    static std::mutex one_at_a_time;
    const std::lock_guard<std::mutex> lock(one_at_a_time);
    serve_host::Block shared(block);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (uint32_t tx = 0; tx < block; ++tx) {
        threads.emplace_back([&, tx] {
            serve_host::block = &shared;
            gridDim = g;
            blockDim = b;
            threadIdx = dim3{tx, 0, 0};
            for (uint32_t bx = 0; bx < grid; ++bx) {
                blockIdx = dim3{bx, 0, 0};
                k(p);
                /* The block's shared memory is the next block's: nobody starts it early. */
                shared.all.arrive_and_wait();
            }
        });
    }
    for (auto &t : threads) {
        t.join();
    }
}

struct Entry {
    const char *name;
    size_t params;
    bool cooperative;
    void (*launch)(bool, uint32_t, uint32_t, const void *);
};

#define SERVE_ENTRY(kernel, P, coop)                                                          \
    Entry {                                                                                   \
        #kernel, sizeof(P), coop, [](bool c, uint32_t g, uint32_t b, const void *p) {         \
            run<P>(kernel, c, g, b, p);                                                       \
        }                                                                                     \
    }

const Entry ENTRIES[] = {
    SERVE_ENTRY(serve_signal, serve_signal_params, false),
    SERVE_ENTRY(serve_embedding_gather, serve_embedding_params, false),
    SERVE_ENTRY(serve_lstm_gather, serve_lstm_gather_params, false),
    SERVE_ENTRY(serve_lstm_pointwise, serve_lstm_pointwise_params, false),
    SERVE_ENTRY(serve_argmax, serve_argmax_params, true),
    SERVE_ENTRY(serve_tree_gather, serve_tree_gather_params, false),
    SERVE_ENTRY(serve_tree_pointwise, serve_tree_pointwise_params, false),
    SERVE_ENTRY(serve_bias_act, serve_bias_act_params, false),
    SERVE_ENTRY(serve_im2col, serve_im2col_params, false),
    SERVE_ENTRY(serve_chw_to_hwc, serve_chw_to_hwc_params, false),
    SERVE_ENTRY(serve_max_pool, serve_max_pool_params, false),
    SERVE_ENTRY(serve_avg_pool, serve_avg_pool_params, false),
    SERVE_ENTRY(serve_add_relu, serve_add_relu_params, false),
    SERVE_ENTRY(serve_layer_norm, serve_layer_norm_params, true),
    SERVE_ENTRY(serve_attention, serve_attention_params, true),
    SERVE_ENTRY(serve_bert_embed, serve_bert_embed_params, false),
};

const Entry *find(const char *name) {
    for (const Entry &e : ENTRIES) {
        if (std::strcmp(e.name, name) == 0) {
            return &e;
        }
    }
    return nullptr;
}

}  // namespace

/* Launch kernel `name` on a host grid of `grid` blocks of `block` threads with its parameter
 * struct at `params` (`params_size` bytes, checked against the struct). Returns 0 when it ran;
 * 1 for an unknown kernel, 2 for a parameter size that is not the kernel's, 3 for a zero grid or
 * block. The kernel's memory must be valid for what its contract (serve_kernels.h) reads and
 * writes; nothing else in the process may touch it during the call. */
extern "C" int serve_host_launch(const char *name, uint32_t grid, uint32_t block, const void *params,
                                 size_t params_size) {
    const Entry *e = find(name);
    if (e == nullptr) {
        return 1;
    }
    if (params_size != e->params) {
        return 2;
    }
    if (grid == 0 || block == 0) {
        return 3;
    }
    e->launch(e->cooperative, grid, block, params);
    return 0;
}

/* The names of the kernels this library can launch, one per call (`index` from 0); null past
 * the last. */
extern "C" const char *serve_host_kernel(size_t index) {
    return index < sizeof ENTRIES / sizeof ENTRIES[0] ? ENTRIES[index].name : nullptr;
}
