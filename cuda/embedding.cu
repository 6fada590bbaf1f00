/*
 * embedding.cu: zero-copy embedding gather (ARCHITECTURE.md §5, serve_kernels.h), the CUDA side of the CPU
 * backend's embed_rows, with the ids checked on the device.
 */
#include "serve_device.cuh"

/* The token id of row r: ids[r], or the token word of the row's slot. SERVE_TOKEN_FROM_SLOT is
 * returned (a bad id) when that slot word cannot be read. */
__device__ __forceinline__ uint32_t serve_row_token(const serve_embedding_params &p, uint64_t r) {
    const uint32_t id = serve_ptr<const uint32_t>(p.ids)[r];
    if (id != SERVE_TOKEN_FROM_SLOT) {
        return id;
    }
    if (p.slots == 0 || p.arena == 0 || p.token_offset >= p.arena_width) {
        return SERVE_TOKEN_FROM_SLOT;
    }
    const uint32_t slot = serve_slot(serve_ptr<const uint32_t>(p.slots)[r], p.arena_slots);
    if (slot > SERVE_SLOT_MASK) {
        return SERVE_TOKEN_FROM_SLOT;
    }
    return serve_ptr<const uint32_t>(p.arena)[(uint64_t)slot * p.arena_width + p.token_offset];
}

SERVE_KERNEL serve_embedding_gather(const serve_embedding_params p) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint64_t warps = serve_grid_threads() / 32u;
    /* float4 accesses when every row start is 16-byte aligned. */
    const bool vec4 = ((p.table | p.out) & 15u) == 0 && (p.width & 3u) == 0 && (p.out_ld & 3u) == 0;
    for (uint64_t r = serve_thread_index() / 32u; r < p.batch; r += warps) {
        const uint32_t id = serve_row_token(p, r);
        const bool bad = id != SERVE_NO_TOKEN && id >= p.table_rows;
        float *out = serve_ptr<float>(p.out) + r * p.out_ld;
        if (id == SERVE_NO_TOKEN || bad) {
            for (uint32_t j = lane; j < p.width; j += 32u) {
                out[j] = 0.0f;
            }
        } else {
            const float *row = serve_ptr<const float>(p.table) + (uint64_t)id * p.width;
            if (vec4) {
                const float4 *src = reinterpret_cast<const float4 *>(row);
                float4 *dst = reinterpret_cast<float4 *>(out);
                for (uint32_t j = lane; j < p.width / 4u; j += 32u) {
                    dst[j] = src[j];
                }
            } else {
                for (uint32_t j = lane; j < p.width; j += 32u) {
                    out[j] = row[j];
                }
            }
        }
        if (lane == 0 && p.errors != 0) {
            serve_ptr<uint32_t>(p.errors)[r] = bad ? SERVE_ROW_BAD_TOKEN : SERVE_ROW_OK;
        }
    }
}
