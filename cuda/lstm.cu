/*
 * lstm.cu: the recurrent cells of cellular batching (ARCHITECTURE.md §5, serve_kernels.h), mirroring the
 * CPU backend (src/backend/cpu/lstm_cell.rs, tree_cell.rs): gather → cuBLAS GEMM → fused
 * pointwise + scatter, for LSTM layers and Child-Sum TreeLSTM nodes, and the decoder's argmax.
 * Arithmetic follows the CPU code's order of operations; σ and tanh are IEEE expf / tanhf.
 */
#include "serve_device.cuh"

/* ---- LSTM layer step ------------------------------------------------------------------------ */

SERVE_KERNEL serve_lstm_gather(const serve_lstm_gather_params p) {
    const uint64_t k = (uint64_t)p.input + p.hidden;
    const uint64_t total = (uint64_t)p.padded * k;
    const uint32_t *slots = serve_ptr<const uint32_t>(p.slots);
    const float *arena = serve_ptr<const float>(p.arena);
    float *xh = serve_ptr<float>(p.xh);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t r = e / k;
        const uint32_t col = (uint32_t)(e - r * k);
        if (col < p.input) {
            if (p.x != 0) {
                xh[e] = serve_ptr<const float>(p.x)[r * p.x_ld + col];
            }
            continue;
        }
        float h = 0.0f;
        if (r < p.rows) {
            const uint32_t word = slots[r];
            const uint32_t slot = serve_slot(word, p.arena_slots);
            if ((word & SERVE_ROW_FRESH) == 0 && slot <= SERVE_SLOT_MASK) {
                h = arena[(uint64_t)slot * p.arena_width + p.offset + (col - p.input)];
            }
        }
        xh[e] = h;
    }
}

SERVE_KERNEL serve_lstm_pointwise(const serve_lstm_pointwise_params p) {
    const uint32_t hd = p.hidden;
    const uint64_t total = (uint64_t)p.padded * hd;
    const float *bias = serve_ptr<const float>(p.bias);
    const uint32_t *slots = serve_ptr<const uint32_t>(p.slots);
    float *arena = serve_ptr<float>(p.arena);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t r = e / hd;
        const uint32_t j = (uint32_t)(e - r * hd);
        const float *g = serve_ptr<const float>(p.gates) + r * 4u * hd;
        const float i = serve_sigmoid(g[j] + bias[j]);
        const float f = serve_sigmoid(g[hd + j] + bias[hd + j]);
        const float gc = tanhf(g[2u * hd + j] + bias[2u * hd + j]);
        const float o = serve_sigmoid(g[3u * hd + j] + bias[3u * hd + j]);
        uint32_t slot = SERVE_SLOT_MASK + 1u;
        bool fresh = true;
        if (r < p.rows) {
            const uint32_t word = slots[r];
            slot = serve_slot(word, p.arena_slots);
            fresh = (word & SERVE_ROW_FRESH) != 0;
        }
        float *state = slot <= SERVE_SLOT_MASK ? arena + (uint64_t)slot * p.arena_width + p.offset : nullptr;
        const float c_prev = (state != nullptr && !fresh) ? state[hd + j] : 0.0f;
        const float c = f * c_prev + i * gc;
        const float h = o * tanhf(c);
        serve_ptr<float>(p.h_out)[r * p.h_out_ld + j] = h;
        if (state != nullptr) {
            state[j] = h;
            state[hd + j] = c;
        }
    }
}

/* ---- Decoder argmax ------------------------------------------------------------------------- */

/* -inf without <math.h>'s INFINITY (NVRTC has no C library headers). */
__device__ __forceinline__ float serve_neg_inf() {
    return __uint_as_float(0xFF800000u);
}

/* (value, index) pairs: the greater value wins, the lower index among equal values. NaN never
 * wins (every comparison with NaN is false) and the neutral element is (-inf, UINT32_MAX). */
__device__ __forceinline__ void serve_argmax_merge(float &v, uint32_t &i, float v2, uint32_t i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

SERVE_KERNEL serve_argmax(const serve_argmax_params p) {
    __shared__ float best_v[SERVE_BLOCK / 32u];
    __shared__ uint32_t best_i[SERVE_BLOCK / 32u];
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t warp = threadIdx.x / 32u;
    const float *bias = serve_ptr<const float>(p.bias);
    for (uint32_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const float *logits = serve_ptr<const float>(p.logits) + (uint64_t)r * p.vocab;
        float v = serve_neg_inf();
        uint32_t i = 0xFFFFFFFFu;
        /* Increasing j per thread: a strict > keeps each thread's first maximum. */
        for (uint32_t j = threadIdx.x; j < p.vocab; j += blockDim.x) {
            const float x = bias != nullptr ? logits[j] + bias[j] : logits[j];
            if (x > v) {
                v = x;
                i = j;
            }
        }
        for (uint32_t d = 16u; d > 0u; d /= 2u) {
            const float v2 = __shfl_down_sync(0xFFFFFFFFu, v, d);
            const uint32_t i2 = __shfl_down_sync(0xFFFFFFFFu, i, d);
            serve_argmax_merge(v, i, v2, i2);
        }
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = i;
        }
        __syncthreads();
        if (warp == 0) {
            v = lane < blockDim.x / 32u ? best_v[lane] : serve_neg_inf();
            i = lane < blockDim.x / 32u ? best_i[lane] : 0xFFFFFFFFu;
            for (uint32_t d = 16u; d > 0u; d /= 2u) {
                const float v2 = __shfl_down_sync(0xFFFFFFFFu, v, d);
                const uint32_t i2 = __shfl_down_sync(0xFFFFFFFFu, i, d);
                serve_argmax_merge(v, i, v2, i2);
            }
            if (lane == 0) {
                const uint32_t token = i == 0xFFFFFFFFu ? 0u : i;
                if (p.tokens != 0) {
                    serve_ptr<uint32_t>(p.tokens)[r] = token;
                }
                if (p.slots != 0 && p.arena != 0 && p.token_offset < p.arena_width) {
                    const uint32_t slot = serve_slot(serve_ptr<const uint32_t>(p.slots)[r], p.arena_slots);
                    if (slot <= SERVE_SLOT_MASK) {
                        serve_ptr<uint32_t>(p.arena)[(uint64_t)slot * p.arena_width + p.token_offset] = token;
                    }
                }
            }
        }
        /* best_v / best_i are reused by the block's next row. */
        __syncthreads();
    }
}

/* ---- Child-Sum TreeLSTM step ---------------------------------------------------------------- */

SERVE_KERNEL serve_tree_gather(const serve_tree_gather_params p) {
    const uint32_t hd = p.hidden;
    const uint64_t total = (uint64_t)p.padded * hd;
    const uint32_t *start = serve_ptr<const uint32_t>(p.child_start);
    const uint32_t *child_slots = serve_ptr<const uint32_t>(p.child_slots);
    const float *arena = serve_ptr<const float>(p.arena);
    float *child_h = serve_ptr<float>(p.child_h);
    float *child_c = serve_ptr<float>(p.child_c);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t r = e / hd;
        const uint32_t j = (uint32_t)(e - r * hd);
        float sum = 0.0f;
        if (r < p.rows) {
            for (uint32_t q = start[r]; q < start[r + 1]; ++q) {
                const uint32_t slot = serve_slot(child_slots[q], p.arena_slots);
                float h = 0.0f;
                float c = 0.0f;
                if (slot <= SERVE_SLOT_MASK) {
                    const float *state = arena + (uint64_t)slot * p.arena_width;
                    h = state[j];
                    c = state[hd + j];
                }
                child_h[(uint64_t)q * hd + j] = h;
                child_c[(uint64_t)q * hd + j] = c;
                sum += h;
            }
        }
        serve_ptr<float>(p.h_sum)[e] = sum;
    }
}

SERVE_KERNEL serve_tree_pointwise(const serve_tree_pointwise_params p) {
    const uint32_t hd = p.hidden;
    const uint64_t total = (uint64_t)p.padded * hd;
    const float *bias = serve_ptr<const float>(p.bias);
    const uint32_t *start = serve_ptr<const uint32_t>(p.child_start);
    const float *fu = serve_ptr<const float>(p.fu);
    const float *child_c = serve_ptr<const float>(p.child_c);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t r = e / hd;
        const uint32_t j = (uint32_t)(e - r * hd);
        const float *gx = serve_ptr<const float>(p.gx) + r * 4u * hd;
        float i;
        float o;
        float c;
        if (p.gu != 0) {
            const float *gu = serve_ptr<const float>(p.gu) + r * 3u * hd;
            i = serve_sigmoid(gx[j] + bias[j] + gu[j]);
            o = serve_sigmoid(gx[hd + j] + bias[hd + j] + gu[hd + j]);
            c = i * tanhf(gx[2u * hd + j] + bias[2u * hd + j] + gu[2u * hd + j]);
        } else {
            i = serve_sigmoid(gx[j] + bias[j]);
            o = serve_sigmoid(gx[hd + j] + bias[hd + j]);
            c = i * tanhf(gx[2u * hd + j] + bias[2u * hd + j]);
        }
        uint32_t slot = SERVE_SLOT_MASK + 1u;
        if (r < p.rows) {
            const float fx = gx[3u * hd + j] + bias[3u * hd + j];
            for (uint32_t q = start[r]; q < start[r + 1]; ++q) {
                c += serve_sigmoid(fx + fu[(uint64_t)q * hd + j]) * child_c[(uint64_t)q * hd + j];
            }
            slot = serve_slot(serve_ptr<const uint32_t>(p.slots)[r], p.arena_slots);
        }
        const float h = o * tanhf(c);
        serve_ptr<float>(p.h_out)[r * p.h_out_ld + j] = h;
        if (slot <= SERVE_SLOT_MASK) {
            float *state = serve_ptr<float>(p.arena) + (uint64_t)slot * p.arena_width;
            state[j] = h;
            state[hd + j] = c;
        }
    }
}
