/*
 * serve_device.cuh: device helpers shared by libserve's kernels. Not part of the ABI.
 *
 * Every .cu file compiles on its own (nvcc or NVRTC) and all of them also compile as one
 * translation unit (build.rs and kernels::nvrtc_program include them one after the other), so
 * helpers live here, once, behind an include guard, and kernels are `extern "C"` (unmangled
 * names, looked up by name from Rust).
 */
#ifndef SERVE_DEVICE_CUH
#define SERVE_DEVICE_CUH

#include "serve_kernels.h"

/* The layouts the Rust mirror (src/backend/cuda/abi.rs) is checked against. */
static_assert(sizeof(serve_dptr) == 8, "serve_dptr is 64 bits");
static_assert(sizeof(serve_signal_params) == 8, "serve_signal_params layout");
static_assert(sizeof(serve_embedding_params) == 80, "serve_embedding_params layout");
static_assert(sizeof(serve_lstm_gather_params) == 64, "serve_lstm_gather_params layout");
static_assert(sizeof(serve_lstm_pointwise_params) == 72, "serve_lstm_pointwise_params layout");
static_assert(sizeof(serve_argmax_params) == 64, "serve_argmax_params layout");
static_assert(sizeof(serve_tree_gather_params) == 72, "serve_tree_gather_params layout");
static_assert(sizeof(serve_tree_pointwise_params) == 96, "serve_tree_pointwise_params layout");
static_assert(sizeof(serve_bias_act_params) == 48, "serve_bias_act_params layout");
static_assert(sizeof(serve_im2col_params) == 56, "serve_im2col_params layout");
static_assert(sizeof(serve_chw_to_hwc_params) == 32, "serve_chw_to_hwc_params layout");
static_assert(sizeof(serve_max_pool_params) == 40, "serve_max_pool_params layout");
static_assert(sizeof(serve_avg_pool_params) == 32, "serve_avg_pool_params layout");
static_assert(sizeof(serve_add_relu_params) == 32, "serve_add_relu_params layout");
static_assert(sizeof(serve_layer_norm_params) == 56, "serve_layer_norm_params layout");
static_assert(sizeof(serve_attention_params) == 56, "serve_attention_params layout");
static_assert(sizeof(serve_bert_embed_params) == 64, "serve_bert_embed_params layout");

/* Block reductions (argmax, LayerNorm, attention) assume whole warps. */
static_assert(SERVE_BLOCK % 32u == 0, "SERVE_BLOCK is a whole number of warps");

#define SERVE_KERNEL extern "C" __global__ void __launch_bounds__(SERVE_BLOCK)

/* A typed view of a device address. */
template <typename T>
__device__ __forceinline__ T *serve_ptr(serve_dptr address) {
    return reinterpret_cast<T *>(address);
}

/* First global thread index and the grid-stride, as 64-bit values (no overflow for big batches). */
__device__ __forceinline__ uint64_t serve_thread_index() {
    return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ uint64_t serve_grid_threads() {
    return (uint64_t)gridDim.x * blockDim.x;
}

/* Slot id of a slot word if it addresses a slot of the arena, else SERVE_SLOT_MASK + 1. */
__device__ __forceinline__ uint32_t serve_slot(uint32_t word, uint32_t arena_slots) {
    const uint32_t slot = word & SERVE_SLOT_MASK;
    return slot < arena_slots ? slot : SERVE_SLOT_MASK + 1u;
}

/* The logistic function, 1 / (1 + e^-x), IEEE expf (no fast-math). */
__device__ __forceinline__ float serve_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

#endif /* SERVE_DEVICE_CUH */
