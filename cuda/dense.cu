/*
 * dense.cu: the pointwise half of a dense layer (ARCHITECTURE.md §5, serve_kernels.h): bias and ReLU,
 * GELU or tanh after the cuBLAS GEMM, as the CPU backend's `linear` (src/backend/cpu/gemm.rs) and
 * BERT's GELU and pooler (transformer.rs).
 */
#include "serve_device.cuh"

SERVE_KERNEL serve_bias_act(const serve_bias_act_params p) {
    const uint32_t cols = p.cols;
    const uint64_t total = (uint64_t)p.rows * cols;
    const float *src = serve_ptr<const float>(p.src);
    const float *bias = p.bias != 0 ? serve_ptr<const float>(p.bias) : nullptr;
    float *dst = serve_ptr<float>(p.dst);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t r = e / cols;
        const uint32_t j = (uint32_t)(e - r * cols);
        float v = src[r * p.src_ld + j];
        if (bias != nullptr) {
            v += bias[j];
        }
        if (p.act == SERVE_ACT_RELU) {
            v = fmaxf(v, 0.0f);
        } else if (p.act == SERVE_ACT_GELU) {
            v = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
        } else if (p.act == SERVE_ACT_TANH) {
            v = tanhf(v);
        }
        dst[r * p.dst_ld + j] = v;
    }
}
