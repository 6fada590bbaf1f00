//! The harness of the CUDA kernel tests (`tests/cuda_kernels.rs`, `tests/cuda_kernels_io.rs`):
//! device 0 with the crate's kernels loaded ([`Gpu`], or a skip), device state arenas and
//! TreeLSTM child lists, launch wrappers that check every range a kernel may touch before
//! launching it, and the host-side references and data the tests compare against.

use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::tree_cell::TreeRow;
use serve::backend::cuda::abi::{
    self, ArgmaxParams, BiasActParams, EmbeddingParams, LstmGatherParams, LstmPointwiseParams,
    TreeGatherParams, TreePointwiseParams,
};
use serve::backend::cuda::kernels::{self, BLOCK, KernelImage, grid};
use serve::backend::cuda::{
    Blas, CudaDevice, DeviceBuffer, Function, LaunchConfig, PinnedMapped, Pod, Stream, libs,
};

use super::gpu::{device, have_nvrtc, skip};

// ---------------------------------------------------------------------------------------------
// Device, skips, launch helpers.

/// Device 0 with the crate's kernels loaded, a stream, and (when asked for) a cuBLAS handle on
/// that stream with TF32 off.
pub struct Gpu {
    pub dev: CudaDevice,
    pub s: Stream,
    pub blas: Option<Blas>,
    pub signal: Function,
    pub embedding: Function,
    pub lstm_gather: Function,
    pub lstm_pointwise: Function,
    pub argmax: Function,
    pub tree_gather: Function,
    pub tree_pointwise: Function,
    pub bias_act: Function,
}

pub fn gpu(with_blas: bool) -> Option<Gpu> {
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
pub trait Mem<T> {
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
pub struct Arena {
    pub buf: DeviceBuffer<f32>,
    pub slots: usize,
    pub width: usize,
}

impl Arena {
    pub fn upload(g: &Gpu, cpu: &StateArena) -> Arena {
        Arena { buf: g.s.upload(&arena_values(cpu)).unwrap(), slots: cpu.slots(), width: cpu.width() }
    }
}

/// Every value of a CPU arena, slot after slot.
pub fn arena_values(a: &StateArena) -> Vec<f32> {
    let mut v = vec![0.0; a.slots() * a.width()];
    for (s, chunk) in v.chunks_exact_mut(a.width().max(1)).enumerate() {
        a.read(s as u32, 0, chunk);
    }
    v
}

/// Rows of a TreeLSTM step's children, validated on the host and uploaded: `start` (prefix sums,
/// `rows + 1`) and the children's slot words.
pub struct Children {
    pub start: DeviceBuffer<u32>,
    pub slots: DeviceBuffer<u32>,
    pub rows: usize,
    pub total: usize,
}

impl Children {
    pub fn new(g: &Gpu, start: &[u32], slots: &[u32]) -> Children {
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
pub fn fits(what: &str, need: usize, have: usize) {
    assert!(need <= have, "{what}: {need} elements needed, the buffer has {have}");
}

/// Elements a row-major `rows × width` view with row stride `ld` spans.
pub fn span(rows: usize, width: usize, ld: usize) -> usize {
    assert!(ld >= width, "row stride {ld} < width {width}");
    if rows == 0 { 0 } else { (rows - 1) * ld + width }
}

pub fn u32_of(n: usize) -> u32 {
    u32::try_from(n).expect("fits a u32")
}

/// A slot word: the slot id, with the fresh flag.
pub fn slot_word(slot: u32, fresh: bool) -> u32 {
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
pub struct SlotTokens<'a> {
    pub slots: &'a DeviceBuffer<u32>,
    pub arena: &'a Arena,
    pub token_offset: usize,
}

impl Gpu {
    fn cfg(units: u64, per_block: u32) -> LaunchConfig {
        LaunchConfig::linear(grid(units, per_block), BLOCK)
    }

    /// `serve_embedding_gather` of `ids.len()` rows; synchronises before returning.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
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
    pub fn lstm_gather(
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
    pub fn lstm_pointwise(
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
    pub fn argmax(
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
    pub fn tree_gather(
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
    pub fn tree_pointwise(
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
    pub fn bias_act(
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
    pub fn gemm(
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
pub fn mix(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0x632B_E59B_D9B4_E019);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

/// `got` ≈ `want` element-wise: |got − want| ≤ 1e-4 · (1 + |want|).
pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= 1e-4 * (1.0 + w.abs());
        assert!(ok, "{what}: element {i}: GPU {g}, CPU {w}");
    }
}

/// Child ranges flattened for the kernels: (child_start prefix sums over `rows`, child slots in
/// row order).
pub fn flatten_children(rows: &[TreeRow], child_slots: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut start = vec![0u32];
    let mut flat = Vec::new();
    for r in rows {
        flat.extend_from_slice(&child_slots[r.children.clone()]);
        start.push(u32_of(flat.len()));
    }
    (start, flat)
}

/// `[W_ih | W_hh]` rows, `[4H, input + H]`, as the GEMM's B operand.
pub fn concat_rows(a: &[f32], a_w: usize, b: &[f32], b_w: usize) -> Vec<f32> {
    a.chunks_exact(a_w).zip(b.chunks_exact(b_w)).flat_map(|(x, y)| x.iter().chain(y).copied()).collect()
}
