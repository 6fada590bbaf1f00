/*
 * layers.cu: the layer models' kernels (ARCHITECTURE.md §5, serve_kernels.h) — ResNet's
 * channels-last im2col, layout change and pooling, the residual add, BERT's embeddings,
 * LayerNorm and attention — mirroring the CPU backend (src/backend/cpu/conv.rs,
 * transformer.rs). The GEMMs between them are cuBLAS's, and the bias + activation after a GEMM
 * is serve_bias_act (dense.cu).
 */
#include "serve_device.cuh"

/* ---- ResNet ----------------------------------------------------------------------------------- */

SERVE_KERNEL serve_im2col(const serve_im2col_params p) {
    const uint64_t kc = (uint64_t)p.k * p.k * p.c;
    const uint64_t total = (uint64_t)p.n * p.oh * p.ow * kc;
    const float *x = serve_ptr<const float>(p.x);
    float *col = serve_ptr<float>(p.col);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t pos = e / kc;
        const uint32_t within = (uint32_t)(e - pos * kc);
        const uint32_t ch = within % p.c;
        const uint32_t kx = (within / p.c) % p.k;
        const uint32_t ky = within / (p.c * p.k);
        const uint64_t img = pos / ((uint64_t)p.oh * p.ow);
        const uint32_t oy = (uint32_t)((pos / p.ow) % p.oh);
        const uint32_t ox = (uint32_t)(pos % p.ow);
        const long long iy = (long long)oy * p.stride - p.pad + ky;
        const long long ix = (long long)ox * p.stride - p.pad + kx;
        float v = 0.0f;
        if (iy >= 0 && ix >= 0 && iy < (long long)p.h && ix < (long long)p.w) {
            v = x[((img * p.h + (uint64_t)iy) * p.w + (uint64_t)ix) * p.c + ch];
        }
        col[e] = v;
    }
}

SERVE_KERNEL serve_chw_to_hwc(const serve_chw_to_hwc_params p) {
    const uint64_t plane = (uint64_t)p.h * p.w;
    const uint64_t image = plane * p.c;
    const uint64_t total = (uint64_t)p.n * image;
    const float *src = serve_ptr<const float>(p.src);
    float *dst = serve_ptr<float>(p.dst);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        /* e indexes the destination: [img, position, channel]. */
        const uint64_t img = e / image;
        const uint64_t rest = e - img * image;
        const uint64_t pos = rest / p.c;
        const uint64_t ch = rest - pos * p.c;
        dst[e] = src[img * image + ch * plane + pos];
    }
}

SERVE_KERNEL serve_max_pool(const serve_max_pool_params p) {
    const uint64_t total = (uint64_t)p.n * p.oh * p.ow * p.c;
    const float *x = serve_ptr<const float>(p.x);
    float *out = serve_ptr<float>(p.out);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint32_t ch = (uint32_t)(e % p.c);
        const uint64_t pos = e / p.c;
        const uint32_t ox = (uint32_t)(pos % p.ow);
        const uint32_t oy = (uint32_t)((pos / p.ow) % p.oh);
        const uint64_t img = pos / ((uint64_t)p.oh * p.ow);
        float m = __uint_as_float(0xFF800000u); /* -inf: padding never wins */
        for (uint32_t ky = 0; ky < 3u; ++ky) {
            const long long iy = (long long)oy * 2 + ky - 1;
            if (iy < 0 || iy >= (long long)p.h) {
                continue;
            }
            for (uint32_t kx = 0; kx < 3u; ++kx) {
                const long long ix = (long long)ox * 2 + kx - 1;
                if (ix < 0 || ix >= (long long)p.w) {
                    continue;
                }
                const float v = x[((img * p.h + (uint64_t)iy) * p.w + (uint64_t)ix) * p.c + ch];
                /* NaN propagates, as torch's max-pool (and the CPU backend) does. */
                if (v > m || v != v) {
                    m = v;
                }
            }
        }
        out[e] = m;
    }
}

SERVE_KERNEL serve_avg_pool(const serve_avg_pool_params p) {
    const uint64_t total = (uint64_t)p.n * p.c;
    const float *x = serve_ptr<const float>(p.x);
    float *out = serve_ptr<float>(p.out);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t img = e / p.c;
        const uint64_t ch = e - img * p.c;
        float sum = 0.0f;
        for (uint32_t q = 0; q < p.positions; ++q) {
            sum += x[(img * p.positions + q) * p.c + ch];
        }
        out[e] = sum / (float)p.positions;
    }
}

SERVE_KERNEL serve_add_relu(const serve_add_relu_params p) {
    const float *a = serve_ptr<const float>(p.a);
    const float *b = serve_ptr<const float>(p.b);
    float *dst = serve_ptr<float>(p.dst);
    for (uint64_t e = serve_thread_index(); e < p.n; e += serve_grid_threads()) {
        dst[e] = fmaxf(a[e] + b[e], 0.0f);
    }
}

/* ---- BERT ------------------------------------------------------------------------------------- */

/* The sum of v over the block's threads, returned to every thread. `shared` holds one value per
 * warp; the block's threads must all call it. */
__device__ __forceinline__ float serve_block_sum(float v, float *shared) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t warp = threadIdx.x / 32u;
    for (uint32_t d = 16u; d > 0u; d /= 2u) {
        v += __shfl_down_sync(0xFFFFFFFFu, v, d);
    }
    if (lane == 0) {
        shared[warp] = v;
    }
    __syncthreads();
    float total = 0.0f;
    for (uint32_t w = 0; w < blockDim.x / 32u; ++w) {
        total += shared[w];
    }
    /* Everyone has read `shared` before it is reused. */
    __syncthreads();
    return total;
}

/* The maximum of v over the block's threads, returned to every thread (as serve_block_sum). */
__device__ __forceinline__ float serve_block_max(float v, float *shared) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t warp = threadIdx.x / 32u;
    for (uint32_t d = 16u; d > 0u; d /= 2u) {
        v = fmaxf(v, __shfl_down_sync(0xFFFFFFFFu, v, d));
    }
    if (lane == 0) {
        shared[warp] = v;
    }
    __syncthreads();
    float m = shared[0];
    for (uint32_t w = 1; w < blockDim.x / 32u; ++w) {
        m = fmaxf(m, shared[w]);
    }
    __syncthreads();
    return m;
}

SERVE_KERNEL serve_layer_norm(const serve_layer_norm_params p) {
    __shared__ float partial[SERVE_BLOCK / 32u];
    const float *x = serve_ptr<const float>(p.x);
    const float *res = p.residual != 0 ? serve_ptr<const float>(p.residual) : nullptr;
    const float *gamma = serve_ptr<const float>(p.gamma);
    const float *beta = serve_ptr<const float>(p.beta);
    float *dst = serve_ptr<float>(p.dst);
    for (uint32_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const uint64_t base = (uint64_t)r * p.cols;
        float s = 0.0f;
        for (uint32_t j = threadIdx.x; j < p.cols; j += blockDim.x) {
            s += x[base + j] + (res != nullptr ? res[base + j] : 0.0f);
        }
        const float mean = serve_block_sum(s, partial) / (float)p.cols;
        float q = 0.0f;
        for (uint32_t j = threadIdx.x; j < p.cols; j += blockDim.x) {
            const float d = x[base + j] + (res != nullptr ? res[base + j] : 0.0f) - mean;
            q += d * d;
        }
        const float inv = 1.0f / sqrtf(serve_block_sum(q, partial) / (float)p.cols + p.eps);
        /* Every thread has read the row (both sums are block-wide) before any writes it: dst may be x. */
        for (uint32_t j = threadIdx.x; j < p.cols; j += blockDim.x) {
            const float v = x[base + j] + (res != nullptr ? res[base + j] : 0.0f);
            dst[base + j] = (v - mean) * inv * gamma[j] + beta[j];
        }
        __syncthreads();
    }
}

SERVE_KERNEL serve_attention(const serve_attention_params p) {
    __shared__ float partial[SERVE_BLOCK / 32u];
    const uint32_t d = p.head_dim;
    const uint64_t hd_all = (uint64_t)p.heads * d;
    const uint64_t ld = 3u * hd_all;
    const float *qkv = serve_ptr<const float>(p.qkv);
    const uint32_t *spans = serve_ptr<const uint32_t>(p.spans);
    float *ctx = serve_ptr<float>(p.ctx);
    const uint64_t blocks = (uint64_t)p.tokens * p.heads;
    for (uint64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
        const uint64_t t = b / p.heads;
        const uint32_t hd = (uint32_t)(b - t * p.heads);
        const uint32_t start = spans[2 * t];
        const uint32_t len = spans[2 * t + 1] < p.max_len ? spans[2 * t + 1] : p.max_len;
        float *s = serve_ptr<float>(p.scores) + b * p.max_len;
        const float *q = qkv + t * ld + (uint64_t)hd * d;
        /* Scores, one key per thread at a time. */
        float m = __uint_as_float(0xFF800000u);
        for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
            const float *k = qkv + ((uint64_t)start + j) * ld + hd_all + (uint64_t)hd * d;
            float dot = 0.0f;
            for (uint32_t e = 0; e < d; ++e) {
                dot += q[e] * k[e];
            }
            s[j] = dot * p.scale;
            m = fmaxf(m, s[j]);
        }
        m = serve_block_max(m, partial);
        float sum = 0.0f;
        for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        /* The block sum also orders every thread's writes of s before the reads below. */
        const float inv = 1.0f / serve_block_sum(sum, partial);
        for (uint32_t e = threadIdx.x; e < d; e += blockDim.x) {
            float acc = 0.0f;
            for (uint32_t j = 0; j < len; ++j) {
                acc += s[j] * qkv[((uint64_t)start + j) * ld + 2u * hd_all + (uint64_t)hd * d + e];
            }
            ctx[t * hd_all + (uint64_t)hd * d + e] = acc * inv;
        }
        /* s is this block's own scratch row; the next (token, head) of this block uses another. */
        __syncthreads();
    }
}

SERVE_KERNEL serve_bert_embed(const serve_bert_embed_params p) {
    const uint64_t total = (uint64_t)p.tokens * p.hidden;
    const uint32_t *ids = serve_ptr<const uint32_t>(p.ids);
    const uint32_t *pos = serve_ptr<const uint32_t>(p.positions);
    const float *word = serve_ptr<const float>(p.word);
    const float *position = serve_ptr<const float>(p.position);
    const float *type0 = serve_ptr<const float>(p.type0);
    float *x = serve_ptr<float>(p.x);
    for (uint64_t e = serve_thread_index(); e < total; e += serve_grid_threads()) {
        const uint64_t t = e / p.hidden;
        const uint32_t j = (uint32_t)(e - t * p.hidden);
        const uint32_t id = ids[t];
        const uint32_t at = pos[t];
        float v = 0.0f;
        if (id < p.vocab && at < p.max_position) {
            v = word[(uint64_t)id * p.hidden + j] + position[(uint64_t)at * p.hidden + j] + type0[j];
        }
        x[e] = v;
    }
}
