//! Every hand-written CUDA kernel (`cuda/*.cu`) against the CPU backend on the same inputs
//! (ARCHITECTURE.md §9, issue 4 item 7):
//!
//! * LSTM layer steps — embedding gather → `serve_lstm_gather` → cuBLAS GEMM →
//!   `serve_lstm_pointwise` — for two stacked layers at batch sizes 1, 3, 64 and 512 (and
//!   h = 1024), scrambled slots, fresh rows (slots holding garbage that must not be read),
//!   padding rows and several steps, against `lstm_layer_step` on a `StateArena` with the same
//!   slots: `h_out` and every slot of the arena, to 1e-4 relative (TF32 off).
//! * `serve_argmax` against `project_argmax`, ties included (exact integer logits), the token
//!   stored in the row's slot and read back by the embedding gather (`SERVE_TOKEN_FROM_SLOT`),
//!   and NaN / ±inf rows against the CPU's documented rule.
//! * `serve_tree_gather` / `serve_tree_pointwise` (with the GEMMs between them) against
//!   `tree_step`, multi-child nodes, leaves and padding in one step.
//! * `serve_embedding_gather` from pinned mapped (zero-copy) and device tables against
//!   `embed_rows`: out-of-range ids give a zero row and the row's error flag and are never read
//!   (guard rows with a sentinel after the table; tables ending exactly at the end of their
//!   allocation; ids up to 2³² − 3), `SERVE_NO_TOKEN` rows are zero, padding columns untouched.
//! * `serve_bias_act` (after a cuBLAS GEMM) against the CPU's `linear`: bias or none, ReLU or
//!   none, out of place (padding columns untouched), in place, into pinned mapped host memory,
//!   NaN through ReLU.
//! * Completion signals: 4 streams × 1000 tasks in flight, each a small kernel writing its task id
//!   into mapped host memory and then the signal kernel; a poller thread sees every counter
//!   monotonic and, for each value it reads, the outputs of the tasks counted already visible
//!   (acquire semantics).
//!
//! With no CUDA device each GPU test prints `skipped: no CUDA device` and passes, unless
//! `SERVE_REQUIRE_GPU=1`, which makes a missing device (or a missing NVRTC / cuBLAS the test
//! needs) a failure. Tests named `host_*` check this file's host-side references and run
//! everywhere.

mod common;

use std::time::{Duration, Instant};

use common::gpu::{device, have_nvrtc, skip};

use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::gemm::{PackedWeight, Threads, linear};
use serve::backend::cpu::lstm_cell::{
    LstmLayer, LstmRow, LstmScratch, Projection, argmax, embed_rows, lstm_layer_step, project_argmax,
};
use serve::backend::cpu::tree_cell::{TreeCell, TreeRow, TreeScratch, tree_step};
use serve::backend::cuda::abi::{
    self, ArgmaxParams, BiasActParams, EmbeddingParams, LstmGatherParams, LstmPointwiseParams, SignalParams,
    TreeGatherParams, TreePointwiseParams,
};
use serve::backend::cuda::kernels::{self, BLOCK, KernelImage, grid};
use serve::backend::cuda::{
    Blas, CudaDevice, DeviceBuffer, Function, LaunchConfig, PinnedMapped, Pod, Stream, libs,
};
use serve::model::NO_TOKEN;
use serve::workload::values;

// ---------------------------------------------------------------------------------------------
// Device, skips, launch helpers.

/// Device 0 with the crate's kernels loaded, a stream, and (when asked for) a cuBLAS handle on
/// that stream with TF32 off.
struct Gpu {
    dev: CudaDevice,
    s: Stream,
    blas: Option<Blas>,
    signal: Function,
    embedding: Function,
    lstm_gather: Function,
    lstm_pointwise: Function,
    argmax: Function,
    tree_gather: Function,
    tree_pointwise: Function,
    bias_act: Function,
}

fn gpu(with_blas: bool) -> Option<Gpu> {
    let dev = device()?;
    // Without a fatbin in this build, the kernels are compiled with NVRTC.
    if matches!(kernels::image(), KernelImage::Sources(_)) && !have_nvrtc(true) {
        return None;
    }
    let m = dev.kernels().unwrap_or_else(|e| panic!("loading the kernels: {e}"));
    let f = |name: &str| m.function(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let s = dev.stream().unwrap();
    let blas = if with_blas {
        if let Err(e) = libs::cublas() {
            return skip(&format!("no cuBLAS ({})", e.message()));
        }
        let mut b = dev.blas(&s).unwrap();
        b.set_tf32(false).unwrap();
        Some(b)
    } else {
        None
    };
    Some(Gpu {
        signal: f(kernels::SIGNAL),
        embedding: f(kernels::EMBEDDING_GATHER),
        lstm_gather: f(kernels::LSTM_GATHER),
        lstm_pointwise: f(kernels::LSTM_POINTWISE),
        argmax: f(kernels::ARGMAX),
        tree_gather: f(kernels::TREE_GATHER),
        tree_pointwise: f(kernels::TREE_POINTWISE),
        bias_act: f(kernels::BIAS_ACT),
        dev,
        s,
        blas,
    })
}

/// Memory a kernel can address: device buffers and pinned mapped host memory.
trait Mem<T> {
    fn addr(&self) -> u64;
    fn elems(&self) -> usize;
}

impl<T: Pod> Mem<T> for DeviceBuffer<T> {
    fn addr(&self) -> u64 {
        self.device_ptr()
    }
    fn elems(&self) -> usize {
        self.len()
    }
}

impl<T: Pod> Mem<T> for PinnedMapped<T> {
    fn addr(&self) -> u64 {
        self.device_ptr()
    }
    fn elems(&self) -> usize {
        self.len()
    }
}

/// A state arena in device memory: `slots × width` 32-bit words.
struct Arena {
    buf: DeviceBuffer<f32>,
    slots: usize,
    width: usize,
}

impl Arena {
    fn upload(g: &Gpu, cpu: &StateArena) -> Arena {
        Arena { buf: g.s.upload(&arena_values(cpu)).unwrap(), slots: cpu.slots(), width: cpu.width() }
    }
}

/// Every value of a CPU arena, slot after slot.
fn arena_values(a: &StateArena) -> Vec<f32> {
    let mut v = vec![0.0; a.slots() * a.width()];
    for (s, chunk) in v.chunks_exact_mut(a.width().max(1)).enumerate() {
        a.read(s as u32, 0, chunk);
    }
    v
}

/// Rows of a TreeLSTM step's children, validated on the host and uploaded: `start` (prefix sums,
/// `rows + 1`) and the children's slot words.
struct Children {
    start: DeviceBuffer<u32>,
    slots: DeviceBuffer<u32>,
    rows: usize,
    total: usize,
}

impl Children {
    fn new(g: &Gpu, start: &[u32], slots: &[u32]) -> Children {
        assert!(!start.is_empty() && start[0] == 0, "child_start starts at 0");
        assert!(start.windows(2).all(|w| w[0] <= w[1]), "child_start is non-decreasing");
        assert_eq!(*start.last().unwrap() as usize, slots.len(), "child_start ends at the child count");
        Children {
            start: g.s.upload(start).unwrap(),
            slots: g.s.upload(slots).unwrap(),
            rows: start.len() - 1,
            total: slots.len(),
        }
    }
}

/// `need` elements fit `have`.
fn fits(what: &str, need: usize, have: usize) {
    assert!(need <= have, "{what}: {need} elements needed, the buffer has {have}");
}

/// Elements a row-major `rows × width` view with row stride `ld` spans.
fn span(rows: usize, width: usize, ld: usize) -> usize {
    assert!(ld >= width, "row stride {ld} < width {width}");
    if rows == 0 { 0 } else { (rows - 1) * ld + width }
}

fn u32_of(n: usize) -> u32 {
    u32::try_from(n).expect("fits a u32")
}

/// A slot word: the slot id, with the fresh flag.
fn slot_word(slot: u32, fresh: bool) -> u32 {
    slot | if fresh { abi::SERVE_ROW_FRESH } else { 0 }
}

// Launch helpers. Each one checks on the host that every range the kernel's contract
// (cuda/serve_kernels.h) lets it touch lies inside the buffers passed, then launches with the
// contract's block size and a one-pass grid. Lifetimes: every address comes from a buffer borrowed
// for the call, and dropping a DeviceBuffer or PinnedMapped first synchronises the context, so a
// kernel never outlives its memory. Host access: device buffers are only reached by copies queued
// on the same stream (ordered after the kernel); helpers that take pinned mapped memory synchronise
// before returning, so the host never touches it while a kernel uses it.

/// A slot-token source for the embedding gather (`SERVE_TOKEN_FROM_SLOT` rows).
struct SlotTokens<'a> {
    slots: &'a DeviceBuffer<u32>,
    arena: &'a Arena,
    token_offset: usize,
}

impl Gpu {
    fn cfg(units: u64, per_block: u32) -> LaunchConfig {
        LaunchConfig::linear(grid(units, per_block), BLOCK)
    }

    /// `serve_embedding_gather` of `ids.len()` rows; synchronises before returning.
    #[allow(clippy::too_many_arguments)]
    fn embed(
        &self,
        table: &dyn Mem<f32>,
        table_rows: usize,
        width: usize,
        ids: &DeviceBuffer<u32>,
        from_slot: Option<&SlotTokens<'_>>,
        out: &DeviceBuffer<f32>,
        out_ld: usize,
        errors: Option<&DeviceBuffer<u32>>,
    ) {
        let batch = ids.len();
        fits("table", table_rows * width, table.elems());
        fits("out", span(batch, width, out_ld), out.len());
        if let Some(e) = errors {
            fits("errors", batch, e.len());
        }
        let (slots, arena, arena_slots, arena_width, token_offset) = match from_slot {
            Some(t) => {
                fits("slots", batch, t.slots.len());
                fits("arena", t.arena.slots * t.arena.width, t.arena.buf.len());
                (t.slots.device_ptr(), t.arena.buf.device_ptr(), t.arena.slots, t.arena.width, t.token_offset)
            }
            None => (0, 0, 0, 0, 0),
        };
        let p = EmbeddingParams {
            table: table.addr(),
            ids: ids.device_ptr(),
            slots,
            arena,
            out: out.device_ptr(),
            errors: errors.map_or(0, |e| e.device_ptr()),
            table_rows: u32_of(table_rows),
            width: u32_of(width),
            batch: u32_of(batch),
            out_ld: u32_of(out_ld),
            arena_slots: u32_of(arena_slots),
            arena_width: u32_of(arena_width),
            token_offset: u32_of(token_offset),
            _pad0: 0,
        };
        // SAFETY: serve_embedding_gather takes one serve_embedding_params (EmbeddingParams, its
        // bindgen mirror) by value. Ranges checked above: the table's `table_rows × width`
        // values, `batch` ids / slot words / error words, `batch` output rows of `width` at stride
        // `out_ld`; the kernel reads an arena word only at a slot id it checked against
        // `arena_slots` and a token offset it checked against `arena_width`, inside the arena
        // (checked). Lifetimes and host access: see the comment above `impl Gpu` (this helper
        // synchronises, for pinned tables).
        unsafe { self.s.launch_with(&self.embedding, Self::cfg(batch as u64, BLOCK / 32), &p) }.unwrap();
        self.s.synchronize().unwrap();
    }

    /// `serve_lstm_gather`: `xh[padded, input + hidden]` from `x` (or in place) and the arena.
    #[allow(clippy::too_many_arguments)]
    fn lstm_gather(
        &self,
        x: Option<(&DeviceBuffer<f32>, usize)>,
        slots: &DeviceBuffer<u32>,
        rows: usize,
        arena: &Arena,
        xh: &DeviceBuffer<f32>,
        (input, hidden): (usize, usize),
        padded: usize,
        offset: usize,
    ) {
        assert!(rows <= padded);
        fits("slots", rows, slots.len());
        fits("xh", padded * (input + hidden), xh.len());
        fits("arena", arena.slots * arena.width, arena.buf.len());
        fits("slot width", offset + 2 * hidden, arena.width);
        let (x_ptr, x_ld) = match x {
            Some((x, ld)) => {
                fits("x", span(padded, input, ld), x.len());
                (x.device_ptr(), ld)
            }
            None => (0, 0),
        };
        let p = LstmGatherParams {
            x: x_ptr,
            slots: slots.device_ptr(),
            arena: arena.buf.device_ptr(),
            xh: xh.device_ptr(),
            input: u32_of(input),
            hidden: u32_of(hidden),
            rows: u32_of(rows),
            padded: u32_of(padded),
            x_ld: u32_of(x_ld),
            arena_slots: u32_of(arena.slots),
            arena_width: u32_of(arena.width),
            offset: u32_of(offset),
        };
        // SAFETY: serve_lstm_gather takes one serve_lstm_gather_params (LstmGatherParams) by value.
        // It reads `padded` rows of `input` values of x at stride x_ld (checked), `rows` slot words
        // (checked), words offset..offset+hidden of range-checked slots (inside the arena:
        // checked), and writes padded × (input + hidden) values of xh (checked). Lifetimes and
        // host access: see the comment above `impl Gpu`.
        let units = (padded * (input + hidden)) as u64;
        unsafe { self.s.launch_with(&self.lstm_gather, Self::cfg(units, BLOCK), &p) }.unwrap();
    }

    /// `serve_lstm_pointwise`: gates + bias → h to `h_out`, h and c to the real rows' slots.
    #[allow(clippy::too_many_arguments)]
    fn lstm_pointwise(
        &self,
        gates: &DeviceBuffer<f32>,
        bias: &DeviceBuffer<f32>,
        slots: &DeviceBuffer<u32>,
        rows: usize,
        arena: &Arena,
        (h_out, h_out_ld): (&DeviceBuffer<f32>, usize),
        hidden: usize,
        padded: usize,
        offset: usize,
    ) {
        assert!(rows <= padded);
        fits("gates", padded * 4 * hidden, gates.len());
        fits("bias", 4 * hidden, bias.len());
        fits("slots", rows, slots.len());
        fits("h_out", span(padded, hidden, h_out_ld), h_out.len());
        fits("arena", arena.slots * arena.width, arena.buf.len());
        fits("slot width", offset + 2 * hidden, arena.width);
        let p = LstmPointwiseParams {
            gates: gates.device_ptr(),
            bias: bias.device_ptr(),
            slots: slots.device_ptr(),
            arena: arena.buf.device_ptr(),
            h_out: h_out.device_ptr(),
            hidden: u32_of(hidden),
            rows: u32_of(rows),
            padded: u32_of(padded),
            h_out_ld: u32_of(h_out_ld),
            arena_slots: u32_of(arena.slots),
            arena_width: u32_of(arena.width),
            offset: u32_of(offset),
            _pad0: 0,
        };
        // SAFETY: serve_lstm_pointwise takes one serve_lstm_pointwise_params (LstmPointwiseParams)
        // by value. It reads padded × 4·hidden gates, 4·hidden biases and `rows` slot words, reads
        // and writes words offset..offset+2·hidden of range-checked slots, and writes `padded`
        // rows of `hidden` values of h_out at stride h_out_ld: all checked above. Lifetimes and
        // host access: see the comment above `impl Gpu`.
        let units = (padded * hidden) as u64;
        unsafe { self.s.launch_with(&self.lstm_pointwise, Self::cfg(units, BLOCK), &p) }.unwrap();
    }

    /// `serve_argmax` of `rows` rows of `vocab` logits.
    fn argmax(
        &self,
        logits: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
        (rows, vocab): (usize, usize),
        to_slots: Option<(&DeviceBuffer<u32>, &Arena, usize)>,
        tokens: &DeviceBuffer<u32>,
    ) {
        fits("logits", rows * vocab, logits.len());
        if let Some(b) = bias {
            fits("bias", vocab, b.len());
        }
        fits("tokens", rows, tokens.len());
        let (slots, arena, arena_slots, arena_width, token_offset) = match to_slots {
            Some((slots, arena, token_offset)) => {
                fits("slots", rows, slots.len());
                fits("arena", arena.slots * arena.width, arena.buf.len());
                (slots.device_ptr(), arena.buf.device_ptr(), arena.slots, arena.width, token_offset)
            }
            None => (0, 0, 0, 0, 0),
        };
        let p = ArgmaxParams {
            logits: logits.device_ptr(),
            bias: bias.map_or(0, |b| b.device_ptr()),
            slots,
            arena,
            tokens: tokens.device_ptr(),
            rows: u32_of(rows),
            vocab: u32_of(vocab),
            arena_slots: u32_of(arena_slots),
            arena_width: u32_of(arena_width),
            token_offset: u32_of(token_offset),
            _pad0: 0,
        };
        // SAFETY: serve_argmax takes one serve_argmax_params (ArgmaxParams) by value. It reads
        // rows × vocab logits, vocab biases and `rows` slot words, writes `rows` tokens, and
        // writes one word (token_offset, checked < arena_width by the kernel) of range-checked
        // slots inside the arena: all checked above. Lifetimes and host access: see the comment
        // above `impl Gpu`.
        unsafe { self.s.launch_with(&self.argmax, LaunchConfig::linear(u32_of(rows.max(1)), BLOCK), &p) }
            .unwrap();
    }

    /// `serve_tree_gather`: the children's h and c, and each row's h̃.
    #[allow(clippy::too_many_arguments)]
    fn tree_gather(
        &self,
        ch: &Children,
        arena: &Arena,
        h_sum: &DeviceBuffer<f32>,
        child_h: &DeviceBuffer<f32>,
        child_c: &DeviceBuffer<f32>,
        hidden: usize,
        padded: usize,
    ) {
        assert!(ch.rows <= padded);
        fits("arena", arena.slots * arena.width, arena.buf.len());
        fits("slot width", 2 * hidden, arena.width);
        fits("h_sum", padded * hidden, h_sum.len());
        fits("child_h", ch.total * hidden, child_h.len());
        fits("child_c", ch.total * hidden, child_c.len());
        let p = TreeGatherParams {
            child_start: ch.start.device_ptr(),
            child_slots: ch.slots.device_ptr(),
            arena: arena.buf.device_ptr(),
            h_sum: h_sum.device_ptr(),
            child_h: child_h.device_ptr(),
            child_c: child_c.device_ptr(),
            hidden: u32_of(hidden),
            rows: u32_of(ch.rows),
            padded: u32_of(padded),
            arena_slots: u32_of(arena.slots),
            arena_width: u32_of(arena.width),
            _pad0: 0,
        };
        // SAFETY: serve_tree_gather takes one serve_tree_gather_params (TreeGatherParams) by
        // value. child_start holds rows + 1 non-decreasing prefix sums ending at the number of
        // child slot words (validated in Children::new), so every child index q it visits is
        // < total: it reads child slot word q, words 0..2·hidden of a range-checked slot, and
        // writes child_h / child_c row q and padded rows of h_sum, all checked above. Lifetimes
        // and host access: see the comment above `impl Gpu`.
        let units = (padded * hidden) as u64;
        unsafe { self.s.launch_with(&self.tree_gather, Self::cfg(units, BLOCK), &p) }.unwrap();
    }

    /// `serve_tree_pointwise`.
    #[allow(clippy::too_many_arguments)]
    fn tree_pointwise(
        &self,
        gx: &DeviceBuffer<f32>,
        gu: Option<&DeviceBuffer<f32>>,
        bias: &DeviceBuffer<f32>,
        ch: &Children,
        fu_cc: Option<(&DeviceBuffer<f32>, &DeviceBuffer<f32>)>,
        node_slots: &DeviceBuffer<u32>,
        arena: &Arena,
        h_out: &DeviceBuffer<f32>,
        hidden: usize,
        padded: usize,
    ) {
        assert!(ch.rows <= padded);
        fits("gx", padded * 4 * hidden, gx.len());
        if let Some(gu) = gu {
            fits("gu", padded * 3 * hidden, gu.len());
        }
        fits("bias", 4 * hidden, bias.len());
        fits("node slots", ch.rows, node_slots.len());
        let (fu, cc) = match fu_cc {
            Some((fu, cc)) => {
                fits("fu", ch.total * hidden, fu.len());
                fits("child_c", ch.total * hidden, cc.len());
                (fu.device_ptr(), cc.device_ptr())
            }
            None => {
                assert_eq!(ch.total, 0, "children need fu and child_c");
                (0, 0)
            }
        };
        fits("arena", arena.slots * arena.width, arena.buf.len());
        fits("slot width", 2 * hidden, arena.width);
        fits("h_out", padded * hidden, h_out.len());
        let p = TreePointwiseParams {
            gx: gx.device_ptr(),
            gu: gu.map_or(0, |g| g.device_ptr()),
            bias: bias.device_ptr(),
            child_start: ch.start.device_ptr(),
            fu,
            child_c: cc,
            slots: node_slots.device_ptr(),
            arena: arena.buf.device_ptr(),
            h_out: h_out.device_ptr(),
            hidden: u32_of(hidden),
            rows: u32_of(ch.rows),
            padded: u32_of(padded),
            h_out_ld: u32_of(hidden),
            arena_slots: u32_of(arena.slots),
            arena_width: u32_of(arena.width),
        };
        // SAFETY: serve_tree_pointwise takes one serve_tree_pointwise_params (TreePointwiseParams)
        // by value. It reads padded × 4H gx, padded × 3H gu (when given), 4H biases, child_start
        // (validated prefix sums: child indices < total), total × H of fu and child_c (null only
        // when total is 0, so never read), `rows` node slot words, writes padded × H of h_out and
        // words 0..2H of range-checked slots: all checked above. Lifetimes and host access: see
        // the comment above `impl Gpu`.
        let units = (padded * hidden) as u64;
        unsafe { self.s.launch_with(&self.tree_pointwise, Self::cfg(units, BLOCK), &p) }.unwrap();
    }

    /// `serve_bias_act`: `dst = act(src + bias)` over `rows × cols`; synchronises before returning
    /// (`dst` may be pinned host memory).
    #[allow(clippy::too_many_arguments)]
    fn bias_act(
        &self,
        (src, src_ld): (&dyn Mem<f32>, usize),
        bias: Option<&DeviceBuffer<f32>>,
        (dst, dst_ld): (&dyn Mem<f32>, usize),
        (rows, cols): (usize, usize),
        relu: bool,
    ) {
        fits("src", span(rows, cols, src_ld), src.elems());
        fits("dst", span(rows, cols, dst_ld), dst.elems());
        if let Some(b) = bias {
            fits("bias", cols, b.len());
        }
        let p = BiasActParams {
            src: src.addr(),
            bias: bias.map_or(0, |b| b.device_ptr()),
            dst: dst.addr(),
            rows: u32_of(rows),
            cols: u32_of(cols),
            src_ld: u32_of(src_ld),
            dst_ld: u32_of(dst_ld),
            act: if relu { abi::SERVE_ACT_RELU } else { abi::SERVE_ACT_NONE },
            _pad0: 0,
        };
        // SAFETY: serve_bias_act takes one serve_bias_act_params (BiasActParams) by value. It
        // reads `rows` rows of `cols` values of src at stride src_ld and `cols` biases, and writes
        // `rows` rows of `cols` values of dst at stride dst_ld: all checked above (src and dst may
        // be the same buffer with the same stride, which the kernel allows). Lifetimes and host
        // access: see the comment above `impl Gpu` (this helper synchronises, for pinned dst).
        let units = (rows * cols) as u64;
        unsafe { self.s.launch_with(&self.bias_act, Self::cfg(units, BLOCK), &p) }.unwrap();
        self.s.synchronize().unwrap();
    }

    /// Row-major `c[m, n] = a[m, k] · b[n, k]ᵀ` with cuBLAS on the test's stream.
    fn gemm(
        &mut self,
        (m, n, k): (usize, usize, usize),
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        c: &mut DeviceBuffer<f32>,
    ) {
        self.blas.as_mut().expect("a cuBLAS handle").gemm_nt(m, n, k, 1.0, a, b, 0.0, c).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Host-side references and data.

/// A deterministic hash of two numbers.
fn mix(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0x632B_E59B_D9B4_E019);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

/// `got` ≈ `want` element-wise: |got − want| ≤ 1e-4 · (1 + |want|).
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= 1e-4 * (1.0 + w.abs());
        assert!(ok, "{what}: element {i}: GPU {g}, CPU {w}");
    }
}

/// Child ranges flattened for the kernels: (child_start prefix sums over `rows`, child slots in
/// row order).
fn flatten_children(rows: &[TreeRow], child_slots: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut start = vec![0u32];
    let mut flat = Vec::new();
    for r in rows {
        flat.extend_from_slice(&child_slots[r.children.clone()]);
        start.push(u32_of(flat.len()));
    }
    (start, flat)
}

/// `[W_ih | W_hh]` rows, `[4H, input + H]`, as the GEMM's B operand.
fn concat_rows(a: &[f32], a_w: usize, b: &[f32], b_w: usize) -> Vec<f32> {
    a.chunks_exact(a_w).zip(b.chunks_exact(b_w)).flat_map(|(x, y)| x.iter().chain(y).copied()).collect()
}

#[test]
fn host_helpers_lay_out_what_the_kernels_read() {
    let rows = [
        TreeRow { slot: 4, children: 1..4 },
        TreeRow { slot: 2, children: 4..4 },
        TreeRow { slot: 0, children: 0..1 },
    ];
    let (start, flat) = flatten_children(&rows, &[9, 7, 8, 6]);
    assert_eq!(start, [0, 3, 3, 4]);
    assert_eq!(flat, [7, 8, 6, 9]);
    assert_eq!(concat_rows(&[1.0, 2.0, 3.0, 4.0], 2, &[5.0, 6.0], 1), [1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
    assert_eq!(span(3, 4, 6), 16);
    assert_eq!(slot_word(5, true), 5 | 0x8000_0000);
}

// ---------------------------------------------------------------------------------------------
// LSTM steps.

/// A two-layer LSTM as the CPU and the GPU each hold it.
struct Lstm {
    vocab: usize,
    table: Vec<f32>,
    cpu: Vec<LstmLayer>,
    /// Per layer: `[W_ih | W_hh]` and `b_ih + b_hh` on the device.
    w: Vec<DeviceBuffer<f32>>,
    bias: Vec<DeviceBuffer<f32>>,
}

impl Lstm {
    fn new(g: &Gpu, e: usize, h: usize, vocab: usize, seed: u64) -> Lstm {
        let s = 1.0 / (h as f32).sqrt();
        let (mut cpu, mut w, mut bias) = (Vec::new(), Vec::new(), Vec::new());
        for layer in 0..2u64 {
            let input = if layer == 0 { e } else { h };
            let k = seed * 10 + layer * 4;
            let w_ih = values(4 * h * input, k, s);
            let w_hh = values(4 * h * h, k + 1, s);
            let b_ih = values(4 * h, k + 2, s);
            let b_hh = values(4 * h, k + 3, s);
            cpu.push(LstmLayer::from_torch(&w_ih, &w_hh, &b_ih, &b_hh, input, h));
            w.push(g.s.upload(&concat_rows(&w_ih, input, &w_hh, h)).unwrap());
            let b: Vec<f32> = b_ih.iter().zip(&b_hh).map(|(a, b)| a + b).collect();
            bias.push(g.s.upload(&b).unwrap());
        }
        Lstm { vocab, table: values(vocab * e, seed * 10 + 9, 1.0), cpu, w, bias }
    }
}

/// Two stacked layers over `requests` requests for `steps` steps, GPU against CPU.
///
/// Slots are a scrambled permutation of an arena with spare slots; every slot starts with
/// garbage. Step 0 runs every request fresh; later steps leave some requests out (their slots
/// must stay untouched), reorder the rows, add 0–2 padding rows, and at step 2 restart some
/// requests in spare slots (fresh rows over garbage). Some rows have no token (zero input). The
/// second layer's input goes through `x` (even steps) or is written in place into its `[x | h]`
/// buffer by the first layer's pointwise kernel (odd steps).
fn check_lstm(g: &mut Gpu, requests: usize, e: usize, h: usize, steps: usize, seed: u64) {
    let m = Lstm::new(g, e, h, 97 + requests, seed);
    let mut table = g.dev.pinned_mapped::<f32>(m.table.len()).unwrap();
    table.write(0, &m.table).unwrap();
    let n_slots = 2 * requests + 3;
    let width = 4 * h + 1; // two layers' h and c, and a word that is never touched
    let cpu_arena = StateArena::new(n_slots, width).unwrap();
    for s in 0..n_slots as u32 {
        cpu_arena.write(s, 0, &values(width, 1000 + s as u64, 3.0));
    }
    let arena = Arena::upload(g, &cpu_arena);
    let mut perm: Vec<u32> = (0..n_slots as u32).collect();
    perm.sort_by_key(|&s| mix(s as u64, seed));
    let mut slot_of: Vec<u32> = perm[..requests].to_vec();
    let mut started = vec![false; requests];
    let mut spare = perm[requests..].iter().copied();
    let mut scratch = LstmScratch::new();
    let (e_h, h4) = (e + h, 4 * h);

    for step in 0..steps {
        if step == 2 {
            for (i, slot) in slot_of.iter_mut().enumerate() {
                if i % 4 == 1 {
                    if let Some(s) = spare.next() {
                        *slot = s;
                        started[i] = false;
                    }
                }
            }
        }
        let mut active: Vec<usize> =
            (0..requests).filter(|&i| step == 0 || (i * 7 + step) % 5 != 0).collect();
        active.sort_by_key(|&i| mix(i as u64, ((step as u64) << 32) | seed));
        let rows: Vec<LstmRow> =
            active.iter().map(|&i| LstmRow { slot: slot_of[i], fresh: !started[i] }).collect();
        let padded = rows.len() + step % 3;
        let mut ids: Vec<u32> = active
            .iter()
            .map(|&i| {
                if (i + step) % 6 == 5 {
                    NO_TOKEN
                } else {
                    (mix(i as u64, step as u64) % m.vocab as u64) as u32
                }
            })
            .collect();
        ids.resize(padded, NO_TOKEN);
        let what =
            format!("requests {requests}, E {e}, H {h}, step {step} ({} rows, padded {padded})", rows.len());

        // CPU.
        let mut x0 = vec![0.0; padded * e];
        embed_rows(&m.table, e, &ids, &mut x0);
        let mut h0 = vec![f32::NAN; padded * h];
        let mut h1 = vec![f32::NAN; padded * h];
        lstm_layer_step(&m.cpu[0], &x0, &rows, padded, &cpu_arena, 0, &mut scratch, &mut h0, Threads(1));
        lstm_layer_step(&m.cpu[1], &h0, &rows, padded, &cpu_arena, 2 * h, &mut scratch, &mut h1, Threads(1));

        // GPU.
        let gpu_before = g.s.download(&arena.buf).unwrap();
        let ids_d = g.s.upload(&ids).unwrap();
        let words: Vec<u32> = rows.iter().map(|r| slot_word(r.slot, r.fresh)).collect();
        let slots_d = g.s.upload(&words).unwrap();
        let xh0 = g.s.upload(&vec![f32::NAN; padded * e_h]).unwrap();
        let xh1 = g.s.upload(&vec![f32::NAN; padded * 2 * h]).unwrap();
        let h0_d = g.s.upload(&vec![f32::NAN; padded * h]).unwrap();
        let h1_d = g.s.upload(&vec![f32::NAN; padded * h]).unwrap();
        let errors = g.s.upload(&vec![0xDEAD_BEEFu32; padded]).unwrap();
        let mut gates = g.dev.alloc::<f32>(padded * h4).unwrap();
        g.embed(&table, m.vocab, e, &ids_d, None, &xh0, e_h, Some(&errors));
        g.lstm_gather(None, &slots_d, rows.len(), &arena, &xh0, (e, h), padded, 0);
        g.gemm((padded, h4, e_h), &xh0, &m.w[0], &mut gates);
        let in_place = step % 2 == 1;
        if in_place {
            g.lstm_pointwise(&gates, &m.bias[0], &slots_d, rows.len(), &arena, (&xh1, 2 * h), h, padded, 0);
            g.lstm_gather(None, &slots_d, rows.len(), &arena, &xh1, (h, h), padded, 2 * h);
        } else {
            g.lstm_pointwise(&gates, &m.bias[0], &slots_d, rows.len(), &arena, (&h0_d, h), h, padded, 0);
            g.lstm_gather(Some((&h0_d, h)), &slots_d, rows.len(), &arena, &xh1, (h, h), padded, 2 * h);
        }
        g.gemm((padded, h4, 2 * h), &xh1, &m.w[1], &mut gates);
        g.lstm_pointwise(&gates, &m.bias[1], &slots_d, rows.len(), &arena, (&h1_d, h), h, padded, 2 * h);

        assert!(
            g.s.download(&errors).unwrap().iter().all(|&w| w == abi::SERVE_ROW_OK),
            "{what}: error words"
        );
        let got_h0: Vec<f32> = if in_place {
            g.s.download(&xh1).unwrap().chunks_exact(2 * h).flat_map(|r| r[..h].to_vec()).collect()
        } else {
            g.s.download(&h0_d).unwrap()
        };
        assert_close(&got_h0, &h0, &format!("{what}: layer 0 h_out"));
        assert_close(&g.s.download(&h1_d).unwrap(), &h1, &format!("{what}: layer 1 h_out"));
        let got = g.s.download(&arena.buf).unwrap();
        let want = arena_values(&cpu_arena);
        for s in 0..n_slots {
            let (got, want) = (&got[s * width..(s + 1) * width], &want[s * width..(s + 1) * width]);
            if rows.iter().any(|r| r.slot as usize == s) {
                assert_close(&got[..4 * h], &want[..4 * h], &format!("{what}: slot {s}"));
                assert_eq!(got[4 * h].to_bits(), want[4 * h].to_bits(), "{what}: slot {s}'s last word");
            } else {
                // Bit for bit as before the step (slots of earlier steps hold the GPU's own
                // rounding, within the tolerance of the CPU's).
                let before = &gpu_before[s * width..(s + 1) * width];
                let same = got.iter().zip(before).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: slot {s} is not in the step and must be untouched");
                assert_close(got, want, &format!("{what}: slot {s}"));
            }
        }
        for &i in &active {
            started[i] = true;
        }
    }
}

#[test]
fn lstm_step_matches_the_cpu_at_batch_1_and_3() {
    let Some(mut g) = gpu(true) else { return };
    check_lstm(&mut g, 1, 8, 16, 5, 1);
    // Odd widths: the embedding gather's scalar path, unaligned rows of [x | h].
    check_lstm(&mut g, 3, 37, 29, 5, 2);
}

#[test]
fn lstm_step_matches_the_cpu_at_batch_64_and_512() {
    let Some(mut g) = gpu(true) else { return };
    check_lstm(&mut g, 64, 64, 128, 4, 3);
    check_lstm(&mut g, 512, 32, 64, 4, 4);
}

#[test]
fn lstm_step_matches_the_cpu_at_gpu_scale() {
    let Some(mut g) = gpu(true) else { return };
    // h = 1024 as benchmarked (ARCHITECTURE.md §8's GPU scale), batch 64.
    check_lstm(&mut g, 64, 1024, 1024, 3, 5);
}

// ---------------------------------------------------------------------------------------------
// Argmax.

#[test]
fn argmax_matches_project_argmax_with_ties_and_feeds_the_next_embedding() {
    let Some(mut g) = gpu(true) else { return };
    // Small integers: every logit is exact on both sides whatever the summation order, so ties are
    // real ties. Vocabularies below a warp, across several warps, and much larger than a block.
    for (hd, vocab, rows) in [(64usize, 20usize, 5usize), (64, 1000, 37), (32, 30522, 7)] {
        let w: Vec<f32> = (0..vocab * hd).map(|i| (mix(i as u64, vocab as u64) % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..vocab).map(|i| (mix(i as u64, 77) % 11) as f32 - 5.0).collect();
        let h: Vec<f32> = (0..rows * hd).map(|i| (mix(i as u64, 78) % 5) as f32 - 2.0).collect();
        let p = Projection::from_torch(&w, &b);
        let mut logits = vec![0.0; rows * vocab];
        let mut want = vec![0u32; rows];
        project_argmax(&p, &h, rows, &mut logits, &mut want, Threads(1));

        // Tokens stored in slots: rows use scrambled slots (flag bits set on some, which the kernel
        // ignores); the last row's slot is out of range (the token is still output, nothing stored).
        let n_slots = rows + 4;
        let width = 3;
        let cpu_arena = StateArena::new(n_slots, width).unwrap();
        for s in 0..n_slots as u32 {
            cpu_arena.write(s, 0, &values(width, 50 + s as u64, 1.0));
        }
        let arena = Arena::upload(&g, &cpu_arena);
        let mut words: Vec<u32> =
            (0..rows as u32).map(|r| slot_word((r * 5 + 2) % n_slots as u32, r % 2 == 0)).collect();
        *words.last_mut().unwrap() = n_slots as u32 + 7;
        let slots_d = g.s.upload(&words).unwrap();

        let (h_d, w_d, b_d) = (g.s.upload(&h).unwrap(), g.s.upload(&w).unwrap(), g.s.upload(&b).unwrap());
        let mut logits_d = g.dev.alloc::<f32>(rows * vocab).unwrap();
        g.gemm((rows, vocab, hd), &h_d, &w_d, &mut logits_d);
        let tokens = g.s.upload(&vec![u32::MAX; rows]).unwrap();
        g.argmax(&logits_d, Some(&b_d), (rows, vocab), Some((&slots_d, &arena, 1)), &tokens);
        let got = g.s.download(&tokens).unwrap();
        assert_eq!(got, want, "vocab {vocab}: GPU argmax vs project_argmax");
        let ties = (0..rows)
            .filter(|&r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                row.iter().filter(|&&x| x == row[want[r] as usize]).count() > 1
            })
            .count();
        println!("vocab {vocab}: {ties} of {rows} rows have tied maxima");

        let before = arena_values(&cpu_arena);
        let after = g.s.download(&arena.buf).unwrap();
        for s in 0..n_slots {
            for j in 0..width {
                let stored =
                    words[..rows - 1].iter().position(|&wd| (wd & abi::SERVE_SLOT_MASK) as usize == s);
                let (a, b) = (after[s * width + j].to_bits(), before[s * width + j].to_bits());
                match stored {
                    Some(r) if j == 1 => assert_eq!(a, want[r], "slot {s} holds row {r}'s token"),
                    _ => assert_eq!(a, b, "slot {s} word {j} untouched"),
                }
            }
        }

        // The next decoder step: SERVE_TOKEN_FROM_SLOT rows embed the token stored in their slot.
        let e = 16;
        let table = values(vocab * e, 90, 1.0);
        let table_d = g.s.upload(&table).unwrap();
        let ids_d = g.s.upload(&vec![abi::SERVE_TOKEN_FROM_SLOT; rows]).unwrap();
        let out = g.dev.alloc::<f32>(rows * e).unwrap();
        let errors = g.dev.alloc::<u32>(rows).unwrap();
        let from = SlotTokens { slots: &slots_d, arena: &arena, token_offset: 1 };
        g.embed(&table_d, vocab, e, &ids_d, Some(&from), &out, e, Some(&errors));
        let mut ref_ids = want.clone();
        *ref_ids.last_mut().unwrap() = NO_TOKEN; // its slot is out of range: a bad row, zeros
        let mut x = vec![0.0; rows * e];
        embed_rows(&table, e, &ref_ids, &mut x);
        assert_eq!(g.s.download(&out).unwrap(), x);
        let mut flags = vec![abi::SERVE_ROW_OK; rows];
        *flags.last_mut().unwrap() = abi::SERVE_ROW_BAD_TOKEN;
        assert_eq!(g.s.download(&errors).unwrap(), flags);
    }
}

#[test]
fn argmax_of_nan_and_infinite_logits_follows_the_cpu_rule() {
    let Some(g) = gpu(false) else { return };
    let vocab = 700;
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let mut cases: Vec<Vec<f32>> = Vec::new();
    let row = |f: &dyn Fn(usize) -> f32| (0..vocab).map(f).collect::<Vec<f32>>();
    cases.push(row(&|_| nan)); // all NaN: 0
    cases.push(row(&|_| -inf)); // nothing beats -inf: 0
    cases.push(row(&|j| if j % 2 == 0 { nan } else { -inf }));
    cases.push(row(&|j| if j == 0 { nan } else { j as f32 % 17.0 })); // NaN first
    cases.push(row(&|j| if j == 699 { 5.0 } else { -1.0 })); // maximum last
    cases.push(row(&|j| if j == 300 || j == 556 || j == 45 { 9.0 } else { 0.0 })); // ties across threads
    cases.push(row(&|j| if j == 33 || j == 1 { 2.0 } else { 1.0 })); // ties across warps of one thread stride
    cases.push(row(&|j| {
        if j == 400 {
            inf
        } else if j == 401 {
            nan
        } else {
            1e30
        }
    }));
    cases.push(row(&|j| if j > 600 { inf } else { 0.0 })); // several +inf: the first
    cases.push(row(&|j| -(j as f32))); // maximum first
    cases.push(row(&|j| if j == 5 { -inf } else { nan })); // -inf is not > -inf
    cases.push(row(&|j| if j == 650 { -3.0e38 } else { nan }));
    let rows = cases.len();
    let logits: Vec<f32> = cases.concat();
    let logits_d = g.s.upload(&logits).unwrap();
    let tokens = g.s.upload(&vec![u32::MAX; rows]).unwrap();
    g.argmax(&logits_d, None, (rows, vocab), None, &tokens);
    let got = g.s.download(&tokens).unwrap();
    let want: Vec<u32> = cases.iter().map(|c| argmax(c)).collect();
    assert_eq!(got, want);
}

// ---------------------------------------------------------------------------------------------
// TreeLSTM.

struct Tree {
    e: usize,
    h: usize,
    cpu: TreeCell,
    wx: DeviceBuffer<f32>,
    bias: DeviceBuffer<f32>,
    u_iou: DeviceBuffer<f32>,
    u_f: DeviceBuffer<f32>,
}

impl Tree {
    fn new(g: &Gpu, e: usize, h: usize, seed: u64) -> Tree {
        let s = 1.0 / (h as f32).sqrt();
        let k = seed * 10;
        let (w_iou, b_iou, u_iou) =
            (values(3 * h * e, k, s), values(3 * h, k + 1, s), values(3 * h * h, k + 2, s));
        let (w_f, b_f, u_f) = (values(h * e, k + 3, s), values(h, k + 4, s), values(h * h, k + 5, s));
        let cpu = TreeCell::from_torch(&w_iou, &b_iou, &u_iou, &w_f, &b_f, &u_f, e, h);
        let wx: Vec<f32> = w_iou.iter().chain(&w_f).copied().collect();
        let bias: Vec<f32> = b_iou.iter().chain(&b_f).copied().collect();
        Tree {
            e,
            h,
            cpu,
            wx: g.s.upload(&wx).unwrap(),
            bias: g.s.upload(&bias).unwrap(),
            u_iou: g.s.upload(&u_iou).unwrap(),
            u_f: g.s.upload(&u_f).unwrap(),
        }
    }
}

/// One TreeLSTM step of `nodes` (slot, child slots) padded to `padded` rows, GPU against CPU, on
/// arenas that start equal; checks h_out and every slot.
fn check_tree_step(
    g: &mut Gpu,
    t: &Tree,
    (cpu_arena, arena): (&StateArena, &Arena),
    nodes: &[(u32, Vec<u32>)],
    padded: usize,
    seed: u64,
) {
    let (e, hd) = (t.e, t.h);
    // CPU child ranges start after an unused entry, as a real step's may.
    let mut child_slots = vec![u32::MAX];
    let rows: Vec<TreeRow> = nodes
        .iter()
        .map(|(slot, ch)| {
            let start = child_slots.len();
            child_slots.extend(ch);
            TreeRow { slot: *slot, children: start..child_slots.len() }
        })
        .collect();
    let mut x = values(padded * e, seed, 1.0);
    x[nodes.len() * e..].fill(0.0);
    let what = format!("tree step of {} nodes (padded {padded}), E {e}, H {hd}", nodes.len());

    let gpu_before = g.s.download(&arena.buf).unwrap();
    let mut scratch = TreeScratch::new();
    let mut h_cpu = vec![f32::NAN; padded * hd];
    tree_step(&t.cpu, &x, &rows, &child_slots, padded, cpu_arena, &mut scratch, &mut h_cpu, Threads(1));

    let (start, flat) = flatten_children(&rows, &child_slots);
    let ch = Children::new(g, &start, &flat);
    // The flag bit of node and child slot words is ignored: set it on some.
    let node_words: Vec<u32> = nodes.iter().enumerate().map(|(i, n)| slot_word(n.0, i % 3 == 1)).collect();
    let node_slots = g.s.upload(&node_words).unwrap();
    let x_d = g.s.upload(&x).unwrap();
    let mut gx = g.dev.alloc::<f32>(padded * 4 * hd).unwrap();
    let h_out = g.s.upload(&vec![f32::NAN; padded * hd]).unwrap();
    g.gemm((padded, 4 * hd, e), &x_d, &t.wx, &mut gx);
    if ch.total > 0 {
        let h_sum = g.s.upload(&vec![f32::NAN; padded * hd]).unwrap();
        let child_h = g.s.upload(&vec![f32::NAN; ch.total * hd]).unwrap();
        let child_c = g.s.upload(&vec![f32::NAN; ch.total * hd]).unwrap();
        let mut gu = g.dev.alloc::<f32>(padded * 3 * hd).unwrap();
        let mut fu = g.dev.alloc::<f32>(ch.total * hd).unwrap();
        g.tree_gather(&ch, arena, &h_sum, &child_h, &child_c, hd, padded);
        g.gemm((padded, 3 * hd, hd), &h_sum, &t.u_iou, &mut gu);
        g.gemm((ch.total, hd, hd), &child_h, &t.u_f, &mut fu);
        g.tree_pointwise(
            &gx,
            Some(&gu),
            &t.bias,
            &ch,
            Some((&fu, &child_c)),
            &node_slots,
            arena,
            &h_out,
            hd,
            padded,
        );
        // h̃ is the children's h summed in child order (the CPU's order).
        let sums = g.s.download(&h_sum).unwrap();
        for (r, w) in start.windows(2).enumerate() {
            let mut want = vec![0.0f32; hd];
            for q in w[0]..w[1] {
                let mut hk = vec![0.0; hd];
                cpu_arena.read(flat[q as usize], 0, &mut hk);
                want.iter_mut().zip(&hk).for_each(|(a, b)| *a += b);
            }
            // Children are read before this step's scatter, which may not overwrite them (a node
            // is never its own child), so the CPU arena still holds what the GPU read.
            assert_close(&sums[r * hd..(r + 1) * hd], &want, &format!("{what}: h_sum row {r}"));
        }
        assert!(sums[nodes.len() * hd..].iter().all(|&v| v == 0.0), "{what}: padding rows' h_sum");
    } else {
        g.tree_pointwise(&gx, None, &t.bias, &ch, None, &node_slots, arena, &h_out, hd, padded);
    }
    assert_close(&g.s.download(&h_out).unwrap(), &h_cpu, &format!("{what}: h_out"));
    let got = g.s.download(&arena.buf).unwrap();
    let want = arena_values(cpu_arena);
    let w = arena.width;
    for s in 0..arena.slots {
        let (got, want) = (&got[s * w..(s + 1) * w], &want[s * w..(s + 1) * w]);
        let before = &gpu_before[s * w..(s + 1) * w];
        // Written words within the tolerance of the CPU's; the others bit for bit as before the
        // step (slots of earlier steps hold the GPU's own rounding).
        let written = if nodes.iter().any(|n| n.0 as usize == s) { 2 * hd } else { 0 };
        assert_close(got, want, &format!("{what}: slot {s}"));
        let same = got[written..].iter().zip(&before[written..]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: slot {s}: words from {written} on must be untouched");
    }
}

#[test]
fn tree_step_matches_the_cpu_with_multi_child_nodes() {
    let Some(mut g) = gpu(true) else { return };
    // The CPU test's tree: leaves, then a three-child node, a leaf and a one-child node in one
    // step, then the root over two internal nodes.
    let (e, hd) = (12, 20);
    let t = Tree::new(&g, e, hd, 1);
    let cpu_arena = StateArena::new(10, 2 * hd + 1).unwrap();
    for s in 0..10 {
        cpu_arena.write(s, 0, &values(2 * hd + 1, 60 + s as u64, 3.0));
    }
    let arena = Arena::upload(&g, &cpu_arena);
    let a = (&cpu_arena, &arena);
    check_tree_step(&mut g, &t, a, &[7, 2, 5, 0].map(|s| (s, vec![])), 6, 1);
    check_tree_step(&mut g, &t, a, &[(9, vec![7, 2, 5]), (4, vec![]), (3, vec![0])], 4, 2);
    check_tree_step(&mut g, &t, a, &[(1, vec![9, 3])], 2, 3);
    check_tree_step(&mut g, &t, a, &[(8, vec![1, 4, 6, 2, 5])], 1, 4); // five children, one unwritten (garbage is data)

    // Batches of 1, 3, 64 and 300 nodes at a wider size: leaves, then parents with 0..=3 children.
    for n in [1usize, 3, 64, 300] {
        let (e, hd) = (48, 96);
        let t = Tree::new(&g, e, hd, 2 + n as u64);
        let slots = 2 * n + 1;
        let cpu_arena = StateArena::new(slots, 2 * hd).unwrap();
        for s in 0..slots as u32 {
            cpu_arena.write(s, 0, &values(2 * hd, 70 + s as u64, 2.0));
        }
        let arena = Arena::upload(&g, &cpu_arena);
        let mut order: Vec<u32> = (0..slots as u32).collect();
        order.sort_by_key(|&s| mix(s as u64, n as u64));
        let leaves: Vec<(u32, Vec<u32>)> = order[..n].iter().map(|&s| (s, vec![])).collect();
        check_tree_step(&mut g, &t, (&cpu_arena, &arena), &leaves, n + 2, 10 + n as u64);
        let parents: Vec<(u32, Vec<u32>)> = (0..n)
            .map(|p| (order[n + p], (0..p % 4).map(|k| order[(p * 5 + k * 3) % n]).collect()))
            .collect();
        check_tree_step(&mut g, &t, (&cpu_arena, &arena), &parents, n + 1, 20 + n as u64);
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding gather.

/// Sentinel stored in guard rows after a table and in output columns the kernel must not write.
const GUARD: f32 = 7777.0;
const UNWRITTEN: f32 = -5555.0;

/// The gather of `ids` from `table` (`rows × width` valid rows), against `embed_rows`.
fn check_embedding(
    g: &Gpu,
    table: &dyn Mem<f32>,
    host: &[f32],
    rows: usize,
    width: usize,
    ids: &[u32],
    what: &str,
) {
    let batch = ids.len();
    // The vectorised path needs out_ld % 4 == 0; the scalar one is exercised by odd widths.
    let out_ld = if width % 4 == 0 { width + 4 } else { width + 3 };
    let out = g.s.upload(&vec![UNWRITTEN; batch * out_ld]).unwrap();
    let errors = g.s.upload(&vec![0xDEAD_BEEFu32; batch]).unwrap();
    let ids_d = g.s.upload(ids).unwrap();
    g.embed(table, rows, width, &ids_d, None, &out, out_ld, Some(&errors));
    let bad = |id: u32| id != NO_TOKEN && id as usize >= rows;
    let ref_ids: Vec<u32> = ids.iter().map(|&id| if bad(id) { NO_TOKEN } else { id }).collect();
    let mut want = vec![0.0; batch * width];
    embed_rows(&host[..rows * width], width, &ref_ids, &mut want);
    let got = g.s.download(&out).unwrap();
    for r in 0..batch {
        let row = &got[r * out_ld..(r + 1) * out_ld];
        assert_eq!(&row[..width], &want[r * width..(r + 1) * width], "{what}: row {r} (id {:#x})", ids[r]);
        assert!(row[width..].iter().all(|&v| v == UNWRITTEN), "{what}: row {r} beyond the width written");
    }
    let flags: Vec<u32> =
        ids.iter().map(|&id| if bad(id) { abi::SERVE_ROW_BAD_TOKEN } else { abi::SERVE_ROW_OK }).collect();
    assert_eq!(g.s.download(&errors).unwrap(), flags, "{what}: error words");

    // Without an error buffer (errors = 0): the same rows.
    let out2 = g.s.upload(&vec![UNWRITTEN; batch * out_ld]).unwrap();
    g.embed(table, rows, width, &ids_d, None, &out2, out_ld, None);
    assert_eq!(g.s.download(&out2).unwrap(), got, "{what}: without error words");
}

/// `n` ids over a table of `rows` rows followed by `guard` guard rows: valid ones (first, last,
/// repeats), no-token rows, and ids just past the end, at the guard rows, and far beyond (which
/// would fault if read); the special ones first.
fn embedding_ids(rows: usize, guard: usize, n: usize) -> Vec<u32> {
    let r = rows as u32;
    let mut ids = match n {
        1 => vec![r],
        3 => vec![r - 1, NO_TOKEN, NO_TOKEN - 2],
        _ => vec![0, r - 1, NO_TOKEN, r, r + 1, 5, 5, 0x7FFF_FFFF, abi::SERVE_TOKEN_FROM_SLOT, NO_TOKEN - 2],
    };
    if n > 3 {
        ids.extend((0..guard as u32).map(|k| r + k));
    }
    let mut i = 0u64;
    while ids.len() < n {
        ids.push(match i % 9 {
            0 => NO_TOKEN,
            1 => r + (mix(i, 5) % 1000) as u32,
            _ => (mix(i, 6) % rows as u64) as u32,
        });
        i += 1;
    }
    ids.truncate(n);
    ids
}

#[test]
fn embedding_gather_from_pinned_and_device_tables_checks_every_id() {
    let Some(g) = gpu(false) else { return };
    // (rows, width): 1024 × 64 floats = 256 KiB and 512 × 30 floats = 60 KiB are whole pages, so
    // the exact-size tables below end at the last byte of their allocation.
    for (rows, width) in [(1024usize, 64usize), (512, 30)] {
        assert_eq!(rows * width * 4 % 4096, 0);
        let guard = 8;
        let host = values(rows * width, rows as u64, 1.0);
        let mut guarded = host.clone();
        guarded.resize((rows + guard) * width, GUARD);
        for batch in [1usize, 3, 64, 512] {
            let ids = embedding_ids(rows, guard, batch);
            // Pinned mapped (zero-copy), exactly the table: ends at the end of the allocation.
            let mut pinned = g.dev.pinned_mapped::<f32>(rows * width).unwrap();
            pinned.write(0, &host).unwrap();
            check_embedding(
                &g,
                &pinned,
                &host,
                rows,
                width,
                &ids,
                &format!("pinned {rows}x{width}, {batch} ids"),
            );
            // Pinned with guard rows after the table: an id the kernel read anyway would show 7777.
            let mut pinned_guard = g.dev.pinned_mapped::<f32>(guarded.len()).unwrap();
            pinned_guard.write(0, &guarded).unwrap();
            check_embedding(
                &g,
                &pinned_guard,
                &guarded,
                rows,
                width,
                &ids,
                &format!("pinned+guard {rows}x{width}"),
            );
            // Device tables, exactly sized and with guard rows.
            let dev_exact = g.s.upload(&host).unwrap();
            check_embedding(
                &g,
                &dev_exact,
                &host,
                rows,
                width,
                &ids,
                &format!("device {rows}x{width}, {batch} ids"),
            );
            let dev_guard = g.s.upload(&guarded).unwrap();
            check_embedding(
                &g,
                &dev_guard,
                &guarded,
                rows,
                width,
                &ids,
                &format!("device+guard {rows}x{width}"),
            );
        }
    }
    // A stray read far outside a table would have raised an illegal-address error by now.
    g.dev.synchronize().unwrap();
}

#[test]
fn embedding_tokens_from_slots_are_checked_too() {
    let Some(g) = gpu(false) else { return };
    let (rows, width) = (100usize, 8usize);
    let host = values(rows * width, 3, 1.0);
    let table = g.s.upload(&host).unwrap();
    // Arena of 4 slots × 3 words; the token lives at word 2.
    let cpu_arena = StateArena::new(4, 3).unwrap();
    for (s, tok) in [(0u32, 7u32), (1, 99), (2, 100), (3, 0xFFFF_FFF0)] {
        cpu_arena.write(s, 0, &[1.5, -2.5]);
        cpu_arena.write_u32(s, 2, tok);
    }
    let arena = Arena::upload(&g, &cpu_arena);
    // Row: (id, slot word) → expected token or bad.
    let cases: [(u32, u32, Option<u32>); 8] = [
        (abi::SERVE_TOKEN_FROM_SLOT, 0, Some(7)),
        (abi::SERVE_TOKEN_FROM_SLOT, 1 | abi::SERVE_ROW_FRESH, Some(99)), // flag bit ignored
        (abi::SERVE_TOKEN_FROM_SLOT, 2, None),                            // token 100 = rows: bad
        (abi::SERVE_TOKEN_FROM_SLOT, 3, None),                            // huge token: bad
        (abi::SERVE_TOKEN_FROM_SLOT, 4, None),                            // slot out of range: bad
        (abi::SERVE_TOKEN_FROM_SLOT, 0x7FFF_FFFF, None),
        (42, 3, Some(42)), // a plain id ignores the slot
        (NO_TOKEN, 3, Some(NO_TOKEN)),
    ];
    let ids_d = g.s.upload(&cases.map(|c| c.0)).unwrap();
    let slots_d = g.s.upload(&cases.map(|c| c.1)).unwrap();
    let out = g.s.upload(&vec![UNWRITTEN; cases.len() * width]).unwrap();
    let errors = g.dev.alloc::<u32>(cases.len()).unwrap();
    let from = SlotTokens { slots: &slots_d, arena: &arena, token_offset: 2 };
    g.embed(&table, rows, width, &ids_d, Some(&from), &out, width, Some(&errors));
    let ref_ids: Vec<u32> = cases.iter().map(|c| c.2.unwrap_or(NO_TOKEN)).collect();
    let mut want = vec![0.0; cases.len() * width];
    embed_rows(&host, width, &ref_ids, &mut want);
    assert_eq!(g.s.download(&out).unwrap(), want);
    let flags: Vec<u32> = cases
        .iter()
        .map(|c| if c.2.is_some() { abi::SERVE_ROW_OK } else { abi::SERVE_ROW_BAD_TOKEN })
        .collect();
    assert_eq!(g.s.download(&errors).unwrap(), flags);

    // A token offset outside the slot, or no slot words at all: every FROM_SLOT row is bad.
    for from in [Some(SlotTokens { slots: &slots_d, arena: &arena, token_offset: 3 }), None] {
        let out = g.s.upload(&vec![UNWRITTEN; cases.len() * width]).unwrap();
        g.embed(&table, rows, width, &ids_d, from.as_ref(), &out, width, Some(&errors));
        let flags: Vec<u32> =
            cases
                .iter()
                .map(|c| {
                    if c.0 == abi::SERVE_TOKEN_FROM_SLOT {
                        abi::SERVE_ROW_BAD_TOKEN
                    } else {
                        abi::SERVE_ROW_OK
                    }
                })
                .collect();
        assert_eq!(g.s.download(&errors).unwrap(), flags);
        let got = g.s.download(&out).unwrap();
        assert!(got[..6 * width].iter().all(|&v| v == 0.0));
        assert_eq!(&got[6 * width..7 * width], &host[42 * width..43 * width]);
    }
}

// ---------------------------------------------------------------------------------------------
// Dense layers.

#[test]
fn bias_act_after_the_gemm_matches_linear() {
    let Some(mut g) = gpu(true) else { return };
    for (rows, k, n) in [(1usize, 16usize, 8usize), (37, 50, 70), (512, 256, 1024)] {
        let x = values(rows * k, 1 + n as u64, 1.0);
        let w = values(n * k, 2 + n as u64, 1.0 / (k as f32).sqrt());
        let b = values(n, 3 + n as u64, 0.5);
        let packed = PackedWeight::from_torch(&w, n, k);
        let (x_d, w_d, b_d) = (g.s.upload(&x).unwrap(), g.s.upload(&w).unwrap(), g.s.upload(&b).unwrap());
        let mut y_d = g.dev.alloc::<f32>(rows * n).unwrap();
        g.gemm((rows, n, k), &x_d, &w_d, &mut y_d);
        for relu in [false, true] {
            let what = format!("{rows}×{k}·{n}, relu {relu}");
            let mut want = vec![0.0; rows * n];
            linear(&x, &packed, &b, &mut want, rows, relu, Threads(1));
            // Out of place, into wider rows whose extra columns stay untouched.
            let ld = n + 3;
            let out = g.s.upload(&vec![UNWRITTEN; rows * ld]).unwrap();
            g.bias_act((&y_d, n), Some(&b_d), (&out, ld), (rows, n), relu);
            let got = g.s.download(&out).unwrap();
            let dense: Vec<f32> = got.chunks_exact(ld).flat_map(|r| r[..n].to_vec()).collect();
            assert_close(&dense, &want, &format!("{what}: out of place"));
            assert!(got.chunks_exact(ld).all(|r| r[n..].iter().all(|&v| v == UNWRITTEN)), "{what}: padding");
            // Into pinned mapped host memory (a zero-copy result).
            let host = g.dev.pinned_mapped::<f32>(rows * n).unwrap();
            g.bias_act((&y_d, n), Some(&b_d), (&host, n), (rows, n), relu);
            assert_close(&host.to_vec(), &want, &format!("{what}: into pinned memory"));
            // In place, on a copy of the GEMM's output.
            let mut inplace = g.dev.alloc::<f32>(rows * n).unwrap();
            g.s.copy(&y_d, 0, &mut inplace, 0, rows * n).unwrap();
            g.bias_act((&inplace, n), Some(&b_d), (&inplace, n), (rows, n), relu);
            assert_close(&g.s.download(&inplace).unwrap(), &want, &format!("{what}: in place"));
        }
        // No bias, no activation: a copy.
        let out = g.dev.alloc::<f32>(rows * n).unwrap();
        g.bias_act((&y_d, n), None, (&out, n), (rows, n), false);
        assert_eq!(g.s.download(&out).unwrap(), g.s.download(&y_d).unwrap());
    }
    // NaN and infinities through the activation, as f32::max(v, 0.0) on the CPU.
    let src = [f32::NAN, -1.0, 2.0, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.5, f32::NAN];
    let src_d = g.s.upload(&src).unwrap();
    let bias = g.s.upload(&[0.0f32, 0.5, -1.0, 1.0]).unwrap();
    let out = g.dev.alloc::<f32>(8).unwrap();
    for relu in [false, true] {
        g.bias_act((&src_d, 4), Some(&bias), (&out, 4), (2, 4), relu);
        let got = g.s.download(&out).unwrap();
        let bias = [0.0f32, 0.5, -1.0, 1.0];
        for (i, (&v, &gv)) in src.iter().zip(&got).enumerate() {
            let pre = v + bias[i % 4];
            let want = if relu { pre.max(0.0) } else { pre };
            assert!(gv == want || (gv.is_nan() && want.is_nan()), "relu {relu}, element {i}: {gv} vs {want}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Completion signals.

#[test]
fn signals_on_four_streams_publish_each_tasks_output_before_its_count() {
    let Some(g) = gpu(false) else { return };
    const STREAMS: usize = 4;
    const TASKS: usize = 1000;
    const W: usize = 256; // floats each task writes into mapped host memory
    // Task t of stream s gathers table row s·TASKS + t, whose every value is that number + 1, into
    // row t of the stream's mapped host output; then the stream's signal.
    let table: Vec<f32> = (0..STREAMS * TASKS).flat_map(|i| std::iter::repeat_n((i + 1) as f32, W)).collect();
    let table = g.s.upload(&table).unwrap();
    let ids: Vec<u32> = (0..(STREAMS * TASKS) as u32).collect();
    let ids = g.s.upload(&ids).unwrap();
    let outs: Vec<PinnedMapped<f32>> =
        (0..STREAMS).map(|_| g.dev.pinned_mapped::<f32>(TASKS * W).unwrap()).collect();
    let streams: Vec<Stream> = (0..STREAMS).map(|_| g.dev.stream().unwrap()).collect();
    let counters = g.dev.signal_counters(STREAMS).unwrap();

    let (observed, checked) = std::thread::scope(|scope| {
        // The poller: acquire loads only, as the runtime's poller.
        let poller = scope.spawn(|| {
            let mut last = [0u64; STREAMS];
            let mut observed = 0usize;
            let mut checked = 0usize;
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut row = vec![0f32; W];
            while last.iter().any(|&l| l < TASKS as u64) {
                for s in 0..STREAMS {
                    let now = counters.completed(s);
                    assert!(
                        now >= last[s] && now <= TASKS as u64,
                        "stream {s}: counter {} then {now}",
                        last[s]
                    );
                    if now > last[s] {
                        observed += 1;
                    }
                    // Every task counted so far has its output visible: the rows of tasks
                    // last..now were written by kernels queued before the signal whose release
                    // increment the acquire load above observed.
                    for t in last[s] as usize..now as usize {
                        outs[s].read(t * W, &mut row).unwrap();
                        let want = (s * TASKS + t + 1) as f32;
                        assert!(
                            row.iter().all(|&v| v == want),
                            "stream {s} count {now}: task {t}'s row not visible"
                        );
                        checked += 1;
                    }
                    last[s] = now;
                }
                assert!(Instant::now() < deadline, "counters stuck at {last:?}");
                std::hint::spin_loop();
            }
            (observed, checked)
        });
        for t in 0..TASKS {
            for (s, st) in streams.iter().enumerate() {
                let p = EmbeddingParams {
                    table: table.device_ptr(),
                    ids: ids.device_ptr_at(s * TASKS + t),
                    out: outs[s].device_ptr() + (t * W * 4) as u64,
                    table_rows: u32_of(STREAMS * TASKS),
                    width: u32_of(W),
                    batch: 1,
                    out_ld: u32_of(W),
                    ..EmbeddingParams::default()
                };
                // SAFETY: serve_embedding_gather takes one EmbeddingParams by value: one id (element
                // s·TASKS + t of `ids`, in range), a table row < table_rows of `table`
                // (STREAMS·TASKS rows of W), and one output row of W floats at row t of the
                // stream's mapped buffer (TASKS rows). All buffers outlive the scope (their drop
                // synchronises the context). The host reads an output row only after the acquire
                // load of the counter shows its task complete, and never writes it.
                unsafe { st.launch_with(&g.embedding, LaunchConfig::linear(1, BLOCK), &p) }.unwrap();
                let sp = SignalParams { counter: counters.device_ptr(s) };
                // SAFETY: serve_signal takes one SignalParams by value; the counter is stream s's
                // line of the mapped counters, alive (an Arc held here) until after the scope,
                // written only by this stream's signal kernels and read by the host with atomics.
                unsafe { st.launch_with(&g.signal, LaunchConfig::linear(1, 1), &sp) }.unwrap();
            }
        }
        poller.join().unwrap()
    });
    for st in &streams {
        st.synchronize().unwrap();
    }
    assert!((0..STREAMS).all(|s| counters.completed(s) == TASKS as u64));
    assert_eq!(checked, STREAMS * TASKS, "every task's output checked once");
    println!("poller saw {observed} counter changes over {} signals", STREAMS * TASKS);
}
