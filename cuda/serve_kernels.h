/*
 * serve_kernels.h: the launch-parameter ABI of libserve's hand-written CUDA kernels (ARCHITECTURE.md §5).
 *
 * Shared by the kernels (the .cu files of cuda/, compiled by nvcc into the embedded fatbin or by NVRTC at run
 * time) and by Rust: src/backend/cuda/abi.rs is generated from this file by bindgen and committed;
 * `cargo test --test cuda_abi` regenerates it and fails on drift (`SERVE_UPDATE_ABI=1` rewrites it).
 *
 * Conventions
 * - Every kernel takes exactly one argument: its parameter struct, by value (one kernel-parameter
 *   pointer to the struct at launch).
 * - Plain C, fixed-width types only, explicit padding: every struct is a multiple of 8 bytes with
 *   no implicit padding, so its layout is the same for nvcc, NVRTC, the host C compiler and Rust.
 * - Pointers are `serve_dptr`: a 64-bit device address (a CUdeviceptr) rather than a typed C
 *   pointer, so that the layout does not depend on the host's pointer size and the Rust mirror is
 *   a plain `u64` (Copy, Send, Sync), exactly what the driver API hands out. The comment on each
 *   field gives the element type and shape the kernel assumes. An address is either a device
 *   allocation or the device address of pinned, mapped host memory (cuMemHostGetDevicePointer);
 *   every kernel works with either. 0 means "absent" only where a field says so.
 * - Matrices are row-major; `*_ld` fields are row strides in elements (>= the row width).
 * - Float data is fp32. GEMMs are not here: cuBLAS does them, launched from Rust.
 * - The state arena is `arena_slots` slots of `arena_width` 32-bit words (ARCHITECTURE.md §5, as the CPU
 *   backend's StateArena): a request's (or tree node's) h and c per layer, and for a seq2seq
 *   decoder its last token as raw u32 bits. Slot ids come from the scheduler and are validated by
 *   the host; the kernels only range-check them so that a bad id can never cause a stray access
 *   (such a row then behaves like a padding row: zero state, nothing scattered).
 *
 * Launch contract (all kernels but serve_signal)
 * - block = (SERVE_BLOCK, 1, 1): the kernels are compiled with __launch_bounds__(SERVE_BLOCK) and
 *   rely on that block size; no dynamic shared memory.
 * - grid = (n, 1, 1) for any n >= 1: every kernel loops grid-stride over its work, so the grid
 *   size only affects speed. Each kernel's comment says what one unit of work is and the grid that
 *   covers it in one pass (capping it, e.g. at a few waves of the device's SMs, is fine).
 * - A batch is `padded` rows of which the first `rows` are real; padding rows are computed like
 *   the others (as in the CPU backend) but never scattered to the arena.
 */
#ifndef SERVE_KERNELS_H
#define SERVE_KERNELS_H

#if defined(__CUDACC_RTC__)
/* NVRTC has no C library headers. */
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

/* Threads per block of every kernel except serve_signal. */
#define SERVE_BLOCK 256u

/* Required alignment in bytes of a completion counter (one counter per cache line). */
#define SERVE_SIGNAL_ALIGN 64u

/* A token id meaning "no token": the row's embedding is a zero row (padding rows, rows not
 * decoding this step). Equal to the CPU backend's NO_TOKEN. */
#define SERVE_NO_TOKEN 0xFFFFFFFFu

/* A token id meaning "the token stored in this row's slot" (a decoder's previous argmax). */
#define SERVE_TOKEN_FROM_SLOT 0xFFFFFFFEu

/* Slot words (the per-row `slots` arrays): the slot id in the low 31 bits, and this bit set when
 * the row starts a sequence (its previous h and c are zero; the slot is written, not read). */
#define SERVE_ROW_FRESH 0x80000000u
#define SERVE_SLOT_MASK 0x7FFFFFFFu

/* Values of a row's error word (serve_embedding_params.errors). */
#define SERVE_ROW_OK 0u
#define SERVE_ROW_BAD_TOKEN 1u

/* A device address (CUdeviceptr). */
typedef uint64_t serve_dptr;

/*
 * serve_signal: completion signal (signal.cu).
 *
 * Launched on a worker's stream after the last kernel / copy of each task. One thread does a
 * system-scope release increment of the stream's counter:
 *   cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>(*counter)
 *       .fetch_add(1, cuda::std::memory_order_release)
 * (`atom.add.release.sys.u64`). Everything the stream did before the kernel is visible to a host
 * thread whose acquire load sees the new count. One writer per counter: the kernel is the only
 * thing that writes it, and a stream runs its launches in order.
 * grid = (1, 1, 1), block = (1, 1, 1).
 */
typedef struct serve_signal_params {
    /* uint64_t*: the counter, SERVE_SIGNAL_ALIGN-aligned, in pinned host memory allocated mapped
     * and not write-combined (cuMemHostAlloc with CU_MEMHOSTALLOC_DEVICEMAP only), given as its
     * device address. */
    serve_dptr counter;
} serve_signal_params;

/*
 * serve_embedding_gather: zero-copy embedding lookup (embedding.cu).
 *
 * out[r, 0..width] = table[id_r, 0..width] for r < batch, where id_r = ids[r], or the token word
 * of slot slots[r] when ids[r] == SERVE_TOKEN_FROM_SLOT. SERVE_NO_TOKEN gives a zero row. An id
 * >= table_rows (or SERVE_TOKEN_FROM_SLOT without a valid slot) is never read: the row is written
 * as zeros and errors[r] = SERVE_ROW_BAD_TOKEN; every other row gets errors[r] = SERVE_ROW_OK.
 * The table may be in pinned mapped host memory (zero-copy: only the rows used cross the bus) or
 * in device memory: same kernel. Also usable as a general row gather (e.g. rows of h_out into a
 * mapped host output buffer).
 * Work: a warp per row, lanes striding the row (float4 when table, out, width and out_ld allow),
 * so each warp access is coalesced. One pass: grid = ceil(batch / (SERVE_BLOCK / 32)).
 */
typedef struct serve_embedding_params {
    /* const float[table_rows, width], rows contiguous. */
    serve_dptr table;
    /* const uint32_t[batch]: token ids. */
    serve_dptr ids;
    /* const uint32_t[batch]: slot words, read only for rows whose id is SERVE_TOKEN_FROM_SLOT;
     * 0 if none. */
    serve_dptr slots;
    /* const uint32_t[arena_slots, arena_width]: the state arena; 0 if none. */
    serve_dptr arena;
    /* float[batch, out_ld]: columns 0..width of each row are written. */
    serve_dptr out;
    /* uint32_t[batch]: per-row error words, all written; 0: not recorded. */
    serve_dptr errors;
    uint32_t table_rows;
    uint32_t width;
    uint32_t batch;
    uint32_t out_ld;
    uint32_t arena_slots;
    uint32_t arena_width;
    /* Word of a slot holding the decoder's last token. */
    uint32_t token_offset;
    uint32_t _pad0;
} serve_embedding_params;

/*
 * serve_lstm_gather: step 1 of an LSTM layer step (lstm.cu): builds X = [x_t | h_{t-1}].
 *
 * For r < padded: xh[r, 0..input] = x[r, 0..input] (skipped when x == 0: the input columns were
 * written in place, e.g. by serve_embedding_gather with out = xh and out_ld = input + hidden, or
 * by the previous layer's serve_lstm_pointwise with h_out = xh); xh[r, input..input+hidden] = the
 * h stored at words offset..offset+hidden of the row's slot for a real, non-fresh row, else 0.
 * Step 2 (cuBLAS, from Rust): gates = X · [W_ih | W_hh]^T, [padded, 4·hidden], no bias.
 * Work: one thread per element of xh. One pass: grid = ceil(padded · (input + hidden) / SERVE_BLOCK).
 */
typedef struct serve_lstm_gather_params {
    /* const float[padded, x_ld]: the layer input (padding rows zero-filled); 0: already in xh. */
    serve_dptr x;
    /* const uint32_t[rows]: slot words (SERVE_ROW_FRESH). */
    serve_dptr slots;
    /* const float[arena_slots, arena_width]. */
    serve_dptr arena;
    /* float[padded, input + hidden]. */
    serve_dptr xh;
    uint32_t input;
    uint32_t hidden;
    uint32_t rows;
    uint32_t padded;
    uint32_t x_ld;
    uint32_t arena_slots;
    uint32_t arena_width;
    /* First word of this layer's state in a slot: h at offset.., c at offset+hidden.. */
    uint32_t offset;
} serve_lstm_gather_params;

/*
 * serve_lstm_pointwise: step 3 of an LSTM layer step (lstm.cu), fused.
 *
 * For r < padded, j < hidden, with gate chunks in PyTorch's order i, f, g, o:
 *   i = σ(gates[r, j] + bias[j])           f = σ(gates[r, H+j] + bias[H+j])
 *   g = tanh(gates[r, 2H+j] + bias[2H+j])  o = σ(gates[r, 3H+j] + bias[3H+j])
 *   c = f · c_prev + i · g,  h = o · tanh(c)
 * where c_prev is read from the row's slot (word offset+hidden+j) for a real, non-fresh row and is
 * 0 otherwise. h goes to h_out[r, j] for every row; a real row's h and c are written back to its
 * slot (words offset+j and offset+hidden+j).
 * Work: one thread per (row, j). One pass: grid = ceil(padded · hidden / SERVE_BLOCK).
 */
typedef struct serve_lstm_pointwise_params {
    /* const float[padded, 4·hidden]: X · [W_ih | W_hh]^T without bias. */
    serve_dptr gates;
    /* const float[4·hidden]: b_ih + b_hh. */
    serve_dptr bias;
    /* const uint32_t[rows]: slot words (SERVE_ROW_FRESH). */
    serve_dptr slots;
    /* float[arena_slots, arena_width]. */
    serve_dptr arena;
    /* float[padded, h_out_ld]: columns 0..hidden written (the next layer's input). */
    serve_dptr h_out;
    uint32_t hidden;
    uint32_t rows;
    uint32_t padded;
    uint32_t h_out_ld;
    uint32_t arena_slots;
    uint32_t arena_width;
    uint32_t offset;
    uint32_t _pad0;
} serve_lstm_pointwise_params;

/*
 * serve_argmax: a decoder step's greedy token (lstm.cu).
 *
 * For r < rows: token = argmax_j (logits[r, j] + bias[j]), the lowest j among equal maxima, NaN
 * values ignored, 0 when no value is greater than -inf (as the CPU backend). The token goes to
 * tokens[r] and, as raw bits, to word token_offset of the row's slot (where the next step's
 * serve_embedding_gather finds it through SERVE_TOKEN_FROM_SLOT).
 * logits come from cuBLAS: h · W^T, [rows, vocab].
 * Work: a block per row (threads stride the row, then a shuffle / shared-memory reduction).
 * One pass: grid = rows.
 */
typedef struct serve_argmax_params {
    /* const float[rows, vocab]. */
    serve_dptr logits;
    /* const float[vocab]; 0: logits already include the bias. */
    serve_dptr bias;
    /* const uint32_t[rows]: slot words (flag bit ignored); 0: tokens are not stored in slots. */
    serve_dptr slots;
    /* uint32_t[arena_slots, arena_width]; 0 when slots is 0. */
    serve_dptr arena;
    /* uint32_t[rows]; 0: not written. */
    serve_dptr tokens;
    uint32_t rows;
    uint32_t vocab;
    uint32_t arena_slots;
    uint32_t arena_width;
    uint32_t token_offset;
    uint32_t _pad0;
} serve_argmax_params;

/*
 * serve_tree_gather: children of a Child-Sum TreeLSTM step (lstm.cu), as the CPU's tree_step.
 *
 * A node slot holds h at words 0..hidden and c at hidden..2·hidden. The children of real row r
 * are child_slots[child_start[r] .. child_start[r+1]] (child_start[0] == 0, prefix sums, in row
 * order); child q's h and c are copied to child_h[q, ..] and child_c[q, ..], and
 * h_sum[r, j] = Σ_q child_h[q, j] (in child order; 0 for a leaf or a padding row).
 * Then (cuBLAS, from Rust): gx = x · [W_iou; W_f]^T [padded, 4H], and when the step has children,
 * gu = h_sum · U_iou^T [padded, 3H] and fu = child_h · U_f^T [children, H].
 * Work: one thread per (row, j), looping over the row's children. One pass:
 * grid = ceil(padded · hidden / SERVE_BLOCK).
 */
typedef struct serve_tree_gather_params {
    /* const uint32_t[rows + 1]. */
    serve_dptr child_start;
    /* const uint32_t[child_start[rows]]: slot words of the children (flag bit ignored). */
    serve_dptr child_slots;
    /* const float[arena_slots, arena_width]. */
    serve_dptr arena;
    /* float[padded, hidden]. */
    serve_dptr h_sum;
    /* float[children, hidden]. */
    serve_dptr child_h;
    /* float[children, hidden]. */
    serve_dptr child_c;
    uint32_t hidden;
    uint32_t rows;
    uint32_t padded;
    uint32_t arena_slots;
    uint32_t arena_width;
    uint32_t _pad0;
} serve_tree_gather_params;

/*
 * serve_tree_pointwise: gates of a Child-Sum TreeLSTM step (lstm.cu), fused, as tree_cell.rs.
 *
 * For r < padded, j < hidden, with gx chunks i, o, u, f and gu chunks i, o, u:
 *   i = σ(gx[r, j] + bias[j] + gu[r, j])             o = σ(gx[r, H+j] + bias[H+j] + gu[r, H+j])
 *   u = tanh(gx[r, 2H+j] + bias[2H+j] + gu[r, 2H+j])
 *   c = i · u + Σ_q σ(gx[r, 3H+j] + bias[3H+j] + fu[q, j]) · child_c[q, j]   (q: r's children)
 *   h = o · tanh(c)
 * (the gu terms are dropped when gu == 0). h goes to h_out[r, j]; a real row's h and c go to its
 * slot (words j and hidden+j).
 * Work: one thread per (row, j). One pass: grid = ceil(padded · hidden / SERVE_BLOCK).
 */
typedef struct serve_tree_pointwise_params {
    /* const float[padded, 4·hidden]: x · [W_iou; W_f]^T without bias. */
    serve_dptr gx;
    /* const float[padded, 3·hidden]: h_sum · U_iou^T; 0 when no row of the step has children. */
    serve_dptr gu;
    /* const float[4·hidden]: [b_iou; b_f]. */
    serve_dptr bias;
    /* const uint32_t[rows + 1]: as serve_tree_gather_params.child_start. */
    serve_dptr child_start;
    /* const float[children, hidden]: child_h · U_f^T. */
    serve_dptr fu;
    /* const float[children, hidden]: from serve_tree_gather. */
    serve_dptr child_c;
    /* const uint32_t[rows]: the nodes' slot words (flag bit ignored). */
    serve_dptr slots;
    /* float[arena_slots, arena_width]. */
    serve_dptr arena;
    /* float[padded, h_out_ld]. */
    serve_dptr h_out;
    uint32_t hidden;
    uint32_t rows;
    uint32_t padded;
    uint32_t h_out_ld;
    uint32_t arena_slots;
    uint32_t arena_width;
} serve_tree_pointwise_params;

/* Activations of serve_bias_act. */
#define SERVE_ACT_NONE 0u
#define SERVE_ACT_RELU 1u
/* GELU, exact: 0.5 · v · (1 + erff(v / √2)) (BERT's intermediate layer). */
#define SERVE_ACT_GELU 2u
/* tanhf(v) (BERT's pooler). */
#define SERVE_ACT_TANH 3u

/*
 * serve_bias_act: bias and activation of a dense layer (dense.cu), after its GEMM, as the CPU
 * backend's `linear`.
 *
 * For r < rows, j < cols: v = src[r, j] + bias[j] (no bias when bias == 0), then
 * ReLU(v) = fmaxf(v, 0) (NaN gives 0, as Rust's f32::max) when act == SERVE_ACT_RELU, GELU or
 * tanh for SERVE_ACT_GELU / SERVE_ACT_TANH; dst[r, j] = v. dst may be src (in place, with dst_ld == src_ld) or another buffer, e.g. the
 * device address of a pinned, mapped host output buffer (zero-copy result).
 * Work: one thread per element. One pass: grid = ceil(rows · cols / SERVE_BLOCK).
 */
typedef struct serve_bias_act_params {
    /* const float[rows, src_ld]: the GEMM's output. */
    serve_dptr src;
    /* const float[cols]; 0: no bias. */
    serve_dptr bias;
    /* float[rows, dst_ld]: columns 0..cols written. */
    serve_dptr dst;
    uint32_t rows;
    uint32_t cols;
    uint32_t src_ld;
    uint32_t dst_ld;
    /* SERVE_ACT_NONE, SERVE_ACT_RELU, SERVE_ACT_GELU or SERVE_ACT_TANH. */
    uint32_t act;
    uint32_t _pad0;
} serve_bias_act_params;

/*
 * Layer models (layers.cu): ResNet's channels-last convolutions and pooling, BERT's embeddings,
 * LayerNorm and attention, as the CPU backend's conv.rs and transformer.rs. The GEMMs between
 * them are cuBLAS's (from Rust).
 */

/*
 * serve_im2col: the patches of a channels-last convolution.
 *
 * For p < n·oh·ow (p = (img·oh + oy)·ow + ox), ky, kx < k, ch < c:
 *   col[p, (ky·k + kx)·c + ch] = x[img, oy·stride − pad + ky, ox·stride − pad + kx, ch]
 * and 0 where that position is outside the image. Then (cuBLAS) out = col · Wᵀ with the
 * BatchNorm folded into W ([out_c, k·k·c], channels innermost), and serve_bias_act.
 * Work: one thread per element of col. One pass: grid = ceil(n·oh·ow·k·k·c / SERVE_BLOCK).
 */
typedef struct serve_im2col_params {
    /* const float[n, h, w, c]. */
    serve_dptr x;
    /* float[n·oh·ow, k·k·c]. */
    serve_dptr col;
    uint32_t n;
    uint32_t h;
    uint32_t w;
    uint32_t c;
    uint32_t k;
    uint32_t stride;
    uint32_t pad;
    uint32_t oh;
    uint32_t ow;
    uint32_t _pad0;
} serve_im2col_params;

/*
 * serve_chw_to_hwc: n images from channels-first (the request's layout) to channels-last:
 * dst[img, p, ch] = src[img, ch, p] for p < h·w.
 * Work: one thread per element. One pass: grid = ceil(n·c·h·w / SERVE_BLOCK).
 */
typedef struct serve_chw_to_hwc_params {
    /* const float[n, c, h, w]. */
    serve_dptr src;
    /* float[n, h, w, c]. */
    serve_dptr dst;
    uint32_t n;
    uint32_t c;
    uint32_t h;
    uint32_t w;
} serve_chw_to_hwc_params;

/*
 * serve_max_pool: 3×3 max-pool, stride 2, padding 1, channels-last (ResNet's stem). Padded
 * positions never win (PyTorch pads with −inf); a NaN in a window gives NaN.
 * out[img, oy, ox, ch] = max over the window's positions inside the image.
 * Work: one thread per output element. One pass: grid = ceil(n·oh·ow·c / SERVE_BLOCK).
 */
typedef struct serve_max_pool_params {
    /* const float[n, h, w, c]. */
    serve_dptr x;
    /* float[n, oh, ow, c]. */
    serve_dptr out;
    uint32_t n;
    uint32_t h;
    uint32_t w;
    uint32_t c;
    uint32_t oh;
    uint32_t ow;
} serve_max_pool_params;

/*
 * serve_avg_pool: the mean over every position, channels-last (ResNet's head):
 * out[img, ch] = Σ_p x[img, p, ch] / positions.
 * Work: one thread per (img, ch), looping over the positions. grid = ceil(n·c / SERVE_BLOCK).
 */
typedef struct serve_avg_pool_params {
    /* const float[n, positions, c]. */
    serve_dptr x;
    /* float[n, c]. */
    serve_dptr out;
    uint32_t n;
    uint32_t positions;
    uint32_t c;
    uint32_t _pad0;
} serve_avg_pool_params;

/*
 * serve_add_relu: the end of a residual block: dst[i] = fmaxf(a[i] + b[i], 0) for i < n. dst may
 * be a.
 * Work: one thread per element. One pass: grid = ceil(n / SERVE_BLOCK).
 */
typedef struct serve_add_relu_params {
    /* const float[n]. */
    serve_dptr a;
    /* const float[n]. */
    serve_dptr b;
    /* float[n]. */
    serve_dptr dst;
    uint64_t n;
} serve_add_relu_params;

/*
 * serve_layer_norm: for r < rows, v = x[r, :] + residual[r, :] (no residual when 0), then
 *   dst[r, j] = (v_j − mean(v)) / sqrt(var(v) + eps) · gamma[j] + beta[j]   (biased variance)
 * dst may be x or residual (in place: each element is read by the thread that writes it, after
 * the row's sums).
 * Work: a block per row (threads stride the row, block reductions of the sum and the squared
 * deviations). grid = rows (any n: rows are strided).
 */
typedef struct serve_layer_norm_params {
    /* const float[rows, cols]. */
    serve_dptr x;
    /* const float[rows, cols]; 0: none. */
    serve_dptr residual;
    /* const float[cols]. */
    serve_dptr gamma;
    /* const float[cols]. */
    serve_dptr beta;
    /* float[rows, cols]. */
    serve_dptr dst;
    uint32_t rows;
    uint32_t cols;
    float eps;
    uint32_t _pad0;
} serve_layer_norm_params;

/*
 * serve_attention: BERT's scaled dot-product attention over each request's own tokens.
 *
 * The task's tokens are packed back to back; qkv[t] = [q | k | v] of token t (3·heads·head_dim
 * values). Token t belongs to the request whose tokens are start..start+len, where
 * spans[2t] = start and spans[2t + 1] = len. For head hd (d = head_dim, H = heads·d):
 *   s_j = scale · Σ_e qkv[t, hd·d + e] · qkv[start + j, H + hd·d + e]            (j < len)
 *   p_j = exp(s_j − max s) / Σ exp(s − max s)
 *   ctx[t, hd·d + e] = Σ_j p_j · qkv[start + j, 2H + hd·d + e]
 * scores is scratch of tokens · heads rows of max_len (len ≤ max_len).
 * Work: a block per (token, head), block = (t · heads + hd): threads stride the keys, then the
 * head's dimensions; block reductions for the max and the sum. grid = tokens · heads.
 */
typedef struct serve_attention_params {
    /* const float[tokens, 3·heads·head_dim]. */
    serve_dptr qkv;
    /* const uint32_t[tokens, 2]: start and length of the token's request. */
    serve_dptr spans;
    /* float[tokens · heads, max_len]: scratch. */
    serve_dptr scores;
    /* float[tokens, heads·head_dim]. */
    serve_dptr ctx;
    uint32_t tokens;
    uint32_t heads;
    uint32_t head_dim;
    uint32_t max_len;
    float scale;
    uint32_t _pad0;
} serve_attention_params;

/*
 * serve_bert_embed: x[t, j] = word[ids[t], j] + position[positions[t], j] + type0[j] (token type
 * 0), then serve_layer_norm. An id ≥ vocab or a position ≥ max_position (checked on the host
 * before; here only range-checked) gives a zero row.
 * Work: one thread per element. One pass: grid = ceil(tokens · hidden / SERVE_BLOCK).
 */
typedef struct serve_bert_embed_params {
    /* const uint32_t[tokens]. */
    serve_dptr ids;
    /* const uint32_t[tokens]. */
    serve_dptr positions;
    /* const float[vocab, hidden]: device memory or pinned, mapped host memory (zero-copy). */
    serve_dptr word;
    /* const float[max_position, hidden]. */
    serve_dptr position;
    /* const float[hidden]: token type 0's embedding. */
    serve_dptr type0;
    /* float[tokens, hidden]. */
    serve_dptr x;
    uint32_t tokens;
    uint32_t hidden;
    uint32_t vocab;
    uint32_t max_position;
} serve_bert_embed_params;

#endif /* SERVE_KERNELS_H */
