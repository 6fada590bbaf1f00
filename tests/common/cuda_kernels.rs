//! The harness of the CUDA kernel tests (`tests/cuda_kernels.rs`, `tests/cuda_kernels_io.rs`,
//! `tests/cuda_kernels_layers.rs`):
//! the kernels run on one of two targets ([`Dev`]) — device 0 with the crate's kernels loaded
//! (or a skip), or the same kernel sources compiled for the CPU and run on host grids
//! (`common::kernels_on_host`, ARCHITECTURE.md §9), so that every kernel's arithmetic and
//! indexing is checked against the CPU backend by `cargo test` on a machine with no GPU — with
//! buffers of either kind ([`Buf`]), state arenas and TreeLSTM child lists, launch wrappers that
//! check every range a kernel may touch before launching it (those of the layer models' kernels,
//! `cuda/layers.cu`, in `common::layer_kernels`), and the host-side references and data the
//! tests compare against.

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
use serve::error::Result;

use super::gpu::{device, have_nvrtc, skip};
use super::kernels_on_host::{HostBuf, HostKernels, UNSET};

// ---------------------------------------------------------------------------------------------
// Targets, buffers, launch helpers.

/// Device 0 with the crate's kernels loaded, a stream, and (when asked for) a cuBLAS handle on
/// that stream with TF32 off.
pub struct Cuda {
    pub dev: CudaDevice,
    pub s: Stream,
    pub blas: Option<Blas>,
    functions: Vec<(&'static str, Function)>,
}

impl Cuda {
    /// The loaded kernel `name` (one of `kernels::KERNELS`).
    pub fn function(&self, name: &str) -> &Function {
        &self.functions.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no kernel {name}")).1
    }
}

/// Where the kernels run.
pub enum Dev {
    Cuda(Cuda),
    /// The kernels compiled for the CPU: grids run on host threads, buffers are host memory.
    Host(&'static HostKernels),
}

/// The GPU target, or `None` after printing why the test is skipped (see `common::gpu`).
pub fn gpu(with_blas: bool) -> Option<Dev> {
    let dev = device()?;
    // Without a fatbin in this build, the kernels are compiled with NVRTC.
    if matches!(kernels::image(), KernelImage::Sources(_)) && !have_nvrtc(true) {
        return None;
    }
    let m = dev.kernels().unwrap_or_else(|e| panic!("loading the kernels: {e}"));
    let functions = kernels::KERNELS
        .iter()
        .map(|&name| (name, m.function(name).unwrap_or_else(|e| panic!("{name}: {e}"))))
        .collect();
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
    Some(Dev::Cuda(Cuda { dev, s, blas, functions }))
}

/// The host target: the kernels built for the CPU (needs a C++20 compiler; `None` only when
/// there is none and `SERVE_SKIP_CPP=1`).
pub fn host() -> Option<Dev> {
    HostKernels::get().map(Dev::Host)
}

/// Memory a kernel can address: device memory, pinned mapped host memory (GPU), or host memory
/// (the host target).
pub enum Buf<T: Pod> {
    Device(DeviceBuffer<T>),
    Pinned(PinnedMapped<T>),
    Host(HostBuf<T>),
}

impl<T: Pod> Buf<T> {
    /// The address a kernel is given.
    pub fn addr(&self) -> u64 {
        match self {
            Buf::Device(b) => b.device_ptr(),
            Buf::Pinned(b) => b.device_ptr(),
            Buf::Host(b) => b.addr(),
        }
    }

    /// The address of element `i` (≤ len).
    pub fn addr_at(&self, i: usize) -> u64 {
        assert!(i <= self.len(), "element {i} of {}", self.len());
        self.addr() + (i * size_of::<T>()) as u64
    }

    pub fn len(&self) -> usize {
        match self {
            Buf::Device(b) => b.len(),
            Buf::Pinned(b) => b.len(),
            Buf::Host(b) => b.len(),
        }
    }

    /// Write `src` at `offset` of host-visible memory (pinned or host).
    pub fn write(&mut self, offset: usize, src: &[T]) -> Result<()> {
        match self {
            Buf::Device(_) => panic!("write a device buffer through Dev::upload"),
            Buf::Pinned(b) => b.write(offset, src),
            Buf::Host(b) => {
                b.write(offset, src);
                Ok(())
            }
        }
    }

    /// The elements of host-visible memory (pinned or host), once the kernels writing it are done
    /// (the launch helpers that take it synchronise).
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            Buf::Device(_) => panic!("read a device buffer through Dev::download"),
            Buf::Pinned(b) => b.to_vec(),
            Buf::Host(b) => b.to_vec(),
        }
    }

    pub fn device(&self) -> &DeviceBuffer<T> {
        match self {
            Buf::Device(b) => b,
            _ => panic!("not a device buffer"),
        }
    }

    fn device_mut(&mut self) -> &mut DeviceBuffer<T> {
        match self {
            Buf::Device(b) => b,
            _ => panic!("not a device buffer"),
        }
    }
}

impl Dev {
    /// "GPU" or "host", for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Dev::Cuda(_) => "GPU",
            Dev::Host(_) => "host",
        }
    }

    /// The CUDA target's parts (device, stream, kernels), for the GPU-only tests.
    pub fn cuda(&self) -> &Cuda {
        match self {
            Dev::Cuda(c) => c,
            Dev::Host(_) => panic!("a GPU-only test on the host target"),
        }
    }

    pub fn upload<T: Pod>(&self, v: &[T]) -> Result<Buf<T>> {
        Ok(match self {
            Dev::Cuda(c) => Buf::Device(c.s.upload(v)?),
            Dev::Host(_) => Buf::Host(HostBuf::from_slice(v)),
        })
    }

    /// `n` elements with unspecified contents (on the host: every byte 0xFF, so an f32 that is
    /// read before being written is a NaN).
    pub fn alloc<T: Pod>(&self, n: usize) -> Result<Buf<T>> {
        Ok(match self {
            Dev::Cuda(c) => Buf::Device(c.dev.alloc(n)?),
            Dev::Host(_) => Buf::Host(HostBuf::filled(n, UNSET)),
        })
    }

    /// Host memory kernels address directly: pinned and mapped (GPU) or plain host memory.
    pub fn pinned<T: Pod>(&self, n: usize) -> Result<Buf<T>> {
        Ok(match self {
            Dev::Cuda(c) => Buf::Pinned(c.dev.pinned_mapped(n)?),
            Dev::Host(_) => Buf::Host(HostBuf::filled(n, 0)),
        })
    }

    /// Every element, after the work queued before.
    pub fn download<T: Pod>(&self, b: &Buf<T>) -> Result<Vec<T>> {
        match (self, b) {
            (Dev::Cuda(c), Buf::Device(d)) => c.s.download(d),
            (Dev::Cuda(c), Buf::Pinned(p)) => {
                c.s.synchronize()?;
                Ok(p.to_vec())
            }
            (_, Buf::Host(h)) => Ok(h.to_vec()),
            (Dev::Host(_), _) => panic!("a GPU buffer on the host target"),
        }
    }

    /// `n` elements from `src[src_offset..]` to `dst[dst_offset..]`.
    pub fn copy<T: Pod>(
        &self,
        src: &Buf<T>,
        src_offset: usize,
        dst: &mut Buf<T>,
        dst_offset: usize,
        n: usize,
    ) {
        match self {
            Dev::Cuda(c) => c.s.copy(src.device(), src_offset, dst.device_mut(), dst_offset, n).unwrap(),
            Dev::Host(_) => {
                let v = self.download(src).unwrap();
                dst.write(dst_offset, &v[src_offset..src_offset + n]).unwrap();
            }
        }
    }

    /// Wait for everything queued.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Dev::Cuda(c) => c.dev.synchronize(),
            Dev::Host(_) => Ok(()),
        }
    }

    pub(super) fn cfg(units: u64, per_block: u32) -> LaunchConfig {
        LaunchConfig::linear(grid(units, per_block), BLOCK)
    }

    /// Launch `kernel` with `params` on the target.
    ///
    /// # Safety
    /// `P` is the kernel's parameter struct, and every address in it belongs to a [`Buf`] of
    /// this target holding what the kernel's contract (`cuda/serve_kernels.h`) reads and writes,
    /// alive until the kernel has run (GPU: dropping a buffer synchronises the context first;
    /// host: the launch runs before returning).
    pub(super) unsafe fn launch<P: Copy>(&self, kernel: &str, cfg: LaunchConfig, params: &P) {
        match self {
            // SAFETY: forwarded contract.
            Dev::Cuda(c) => unsafe { c.s.launch_with(c.function(kernel), cfg, params) }.unwrap(),
            // SAFETY: forwarded contract; on the host target every buffer is host memory.
            Dev::Host(h) => unsafe { h.launch(kernel, cfg, params) },
        }
    }
}

/// A state arena in kernel-addressable memory: `slots × width` 32-bit words.
pub struct Arena {
    pub buf: Buf<f32>,
    pub slots: usize,
    pub width: usize,
}

impl Arena {
    pub fn upload(g: &Dev, cpu: &StateArena) -> Arena {
        Arena { buf: g.upload(&arena_values(cpu)).unwrap(), slots: cpu.slots(), width: cpu.width() }
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
    pub start: Buf<u32>,
    pub slots: Buf<u32>,
    pub rows: usize,
    pub total: usize,
}

impl Children {
    pub fn new(g: &Dev, start: &[u32], slots: &[u32]) -> Children {
        assert!(!start.is_empty() && start[0] == 0, "child_start starts at 0");
        assert!(start.windows(2).all(|w| w[0] <= w[1]), "child_start is non-decreasing");
        assert_eq!(*start.last().unwrap() as usize, slots.len(), "child_start ends at the child count");
        Children {
            start: g.upload(start).unwrap(),
            slots: g.upload(slots).unwrap(),
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

/// `serve_bias_act`'s activation for a ReLU flag.
pub fn relu_act(on: bool) -> u32 {
    if on { abi::SERVE_ACT_RELU } else { abi::SERVE_ACT_NONE }
}

/// A slot word: the slot id, with the fresh flag.
pub fn slot_word(slot: u32, fresh: bool) -> u32 {
    slot | if fresh { abi::SERVE_ROW_FRESH } else { 0 }
}

// Launch helpers. Each one checks on the host that every range the kernel's contract
// (cuda/serve_kernels.h) lets it touch lies inside the buffers passed, then launches with the
// contract's block size and a one-pass grid. Lifetimes: every address comes from a buffer borrowed
// for the call, and dropping a DeviceBuffer or PinnedMapped first synchronises the context, so a
// kernel never outlives its memory (on the host target a launch has run when it returns). Host
// access: device buffers are only reached by copies queued on the same stream (ordered after the
// kernel); helpers that take pinned mapped memory synchronise before returning, so the host never
// touches it while a kernel uses it.

/// A slot-token source for the embedding gather (`SERVE_TOKEN_FROM_SLOT` rows).
pub struct SlotTokens<'a> {
    pub slots: &'a Buf<u32>,
    pub arena: &'a Arena,
    pub token_offset: usize,
}

impl Dev {
    /// `serve_embedding_gather` of `ids.len()` rows; synchronises before returning.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        table: &Buf<f32>,
        table_rows: usize,
        width: usize,
        ids: &Buf<u32>,
        from_slot: Option<&SlotTokens<'_>>,
        out: &Buf<f32>,
        out_ld: usize,
        errors: Option<&Buf<u32>>,
    ) {
        let batch = ids.len();
        fits("table", table_rows * width, table.len());
        fits("out", span(batch, width, out_ld), out.len());
        if let Some(e) = errors {
            fits("errors", batch, e.len());
        }
        let (slots, arena, arena_slots, arena_width, token_offset) = match from_slot {
            Some(t) => {
                fits("slots", batch, t.slots.len());
                fits("arena", t.arena.slots * t.arena.width, t.arena.buf.len());
                (t.slots.addr(), t.arena.buf.addr(), t.arena.slots, t.arena.width, t.token_offset)
            }
            None => (0, 0, 0, 0, 0),
        };
        let p = EmbeddingParams {
            table: table.addr(),
            ids: ids.addr(),
            slots,
            arena,
            out: out.addr(),
            errors: errors.map_or(0, |e| e.addr()),
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
        // (checked). Lifetimes and host access: see the comment above `impl Dev` (this helper
        // synchronises, for pinned tables).
        unsafe { self.launch(kernels::EMBEDDING_GATHER, Self::cfg(batch as u64, BLOCK / 32), &p) };
        self.synchronize().unwrap();
    }

    /// `serve_lstm_gather`: `xh[padded, input + hidden]` from `x` (or in place) and the arena.
    #[allow(clippy::too_many_arguments)]
    pub fn lstm_gather(
        &self,
        x: Option<(&Buf<f32>, usize)>,
        slots: &Buf<u32>,
        rows: usize,
        arena: &Arena,
        xh: &Buf<f32>,
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
                (x.addr(), ld)
            }
            None => (0, 0),
        };
        let p = LstmGatherParams {
            x: x_ptr,
            slots: slots.addr(),
            arena: arena.buf.addr(),
            xh: xh.addr(),
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
        // host access: see the comment above `impl Dev`.
        let units = (padded * (input + hidden)) as u64;
        unsafe { self.launch(kernels::LSTM_GATHER, Self::cfg(units, BLOCK), &p) };
    }

    /// `serve_lstm_pointwise`: gates + bias → h to `h_out`, h and c to the real rows' slots.
    #[allow(clippy::too_many_arguments)]
    pub fn lstm_pointwise(
        &self,
        gates: &Buf<f32>,
        bias: &Buf<f32>,
        slots: &Buf<u32>,
        rows: usize,
        arena: &Arena,
        (h_out, h_out_ld): (&Buf<f32>, usize),
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
            gates: gates.addr(),
            bias: bias.addr(),
            slots: slots.addr(),
            arena: arena.buf.addr(),
            h_out: h_out.addr(),
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
        // host access: see the comment above `impl Dev`.
        let units = (padded * hidden) as u64;
        unsafe { self.launch(kernels::LSTM_POINTWISE, Self::cfg(units, BLOCK), &p) };
    }

    /// `serve_argmax` of `rows` rows of `vocab` logits.
    pub fn argmax(
        &self,
        logits: &Buf<f32>,
        bias: Option<&Buf<f32>>,
        (rows, vocab): (usize, usize),
        to_slots: Option<(&Buf<u32>, &Arena, usize)>,
        tokens: &Buf<u32>,
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
                (slots.addr(), arena.buf.addr(), arena.slots, arena.width, token_offset)
            }
            None => (0, 0, 0, 0, 0),
        };
        let p = ArgmaxParams {
            logits: logits.addr(),
            bias: bias.map_or(0, |b| b.addr()),
            slots,
            arena,
            tokens: tokens.addr(),
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
        // above `impl Dev`.
        unsafe { self.launch(kernels::ARGMAX, LaunchConfig::linear(u32_of(rows.max(1)), BLOCK), &p) };
    }

    /// `serve_tree_gather`: the children's h and c, and each row's h̃.
    #[allow(clippy::too_many_arguments)]
    pub fn tree_gather(
        &self,
        ch: &Children,
        arena: &Arena,
        h_sum: &Buf<f32>,
        child_h: &Buf<f32>,
        child_c: &Buf<f32>,
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
            child_start: ch.start.addr(),
            child_slots: ch.slots.addr(),
            arena: arena.buf.addr(),
            h_sum: h_sum.addr(),
            child_h: child_h.addr(),
            child_c: child_c.addr(),
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
        // and host access: see the comment above `impl Dev`.
        let units = (padded * hidden) as u64;
        unsafe { self.launch(kernels::TREE_GATHER, Self::cfg(units, BLOCK), &p) };
    }

    /// `serve_tree_pointwise`.
    #[allow(clippy::too_many_arguments)]
    pub fn tree_pointwise(
        &self,
        gx: &Buf<f32>,
        gu: Option<&Buf<f32>>,
        bias: &Buf<f32>,
        ch: &Children,
        fu_cc: Option<(&Buf<f32>, &Buf<f32>)>,
        node_slots: &Buf<u32>,
        arena: &Arena,
        h_out: &Buf<f32>,
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
                (fu.addr(), cc.addr())
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
            gx: gx.addr(),
            gu: gu.map_or(0, |g| g.addr()),
            bias: bias.addr(),
            child_start: ch.start.addr(),
            fu,
            child_c: cc,
            slots: node_slots.addr(),
            arena: arena.buf.addr(),
            h_out: h_out.addr(),
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
        // the comment above `impl Dev`.
        let units = (padded * hidden) as u64;
        unsafe { self.launch(kernels::TREE_POINTWISE, Self::cfg(units, BLOCK), &p) };
    }

    /// `serve_bias_act`: `dst = act(src + bias)` over `rows × cols` (`act` one of
    /// `abi::SERVE_ACT_*`, [`relu_act`] for a flag); synchronises before returning (`dst` may be
    /// pinned host memory).
    pub fn bias_act(
        &self,
        (src, src_ld): (&Buf<f32>, usize),
        bias: Option<&Buf<f32>>,
        (dst, dst_ld): (&Buf<f32>, usize),
        (rows, cols): (usize, usize),
        act: u32,
    ) {
        fits("src", span(rows, cols, src_ld), src.len());
        fits("dst", span(rows, cols, dst_ld), dst.len());
        if let Some(b) = bias {
            fits("bias", cols, b.len());
        }
        let p = BiasActParams {
            src: src.addr(),
            bias: bias.map_or(0, |b| b.addr()),
            dst: dst.addr(),
            rows: u32_of(rows),
            cols: u32_of(cols),
            src_ld: u32_of(src_ld),
            dst_ld: u32_of(dst_ld),
            act,
            _pad0: 0,
        };
        // SAFETY: serve_bias_act takes one serve_bias_act_params (BiasActParams) by value. It
        // reads `rows` rows of `cols` values of src at stride src_ld and `cols` biases, and writes
        // `rows` rows of `cols` values of dst at stride dst_ld: all checked above (src and dst may
        // be the same buffer with the same stride, which the kernel allows). Lifetimes and host
        // access: see the comment above `impl Dev` (this helper synchronises, for pinned dst).
        let units = (rows * cols) as u64;
        unsafe { self.launch(kernels::BIAS_ACT, Self::cfg(units, BLOCK), &p) };
        self.synchronize().unwrap();
    }

    /// `serve_signal` on a `grid × block` launch: one release increment of `counter[0]` (only
    /// thread 0 of block 0 counts); synchronises before returning.
    pub fn signal(&self, counter: &Buf<u64>, grid: u32, block: u32) {
        fits("counter", 1, counter.len());
        assert_eq!(counter.addr() % u64::from(abi::SERVE_SIGNAL_ALIGN), 0, "counter alignment");
        let p = abi::SignalParams { counter: counter.addr() };
        // SAFETY: serve_signal takes one serve_signal_params (SignalParams) by value and writes
        // one aligned 64-bit word at `counter` (checked above). Lifetimes and host access: see the
        // comment above `impl Dev` (this helper synchronises).
        unsafe { self.launch(kernels::SIGNAL, LaunchConfig::linear(grid, block), &p) };
        self.synchronize().unwrap();
    }

    /// Row-major `c[m, n] = a[m, k] · b[n, k]ᵀ`: cuBLAS on the test's stream (FP32, TF32 off), or
    /// on the host target `matrixmultiply`'s sgemm (the GEMMs are cuBLAS's, not the crate's
    /// kernels: the host target checks the kernels around them).
    pub fn gemm(&mut self, (m, n, k): (usize, usize, usize), a: &Buf<f32>, b: &Buf<f32>, c: &mut Buf<f32>) {
        match self {
            Dev::Cuda(cu) => cu
                .blas
                .as_mut()
                .expect("a cuBLAS handle")
                .gemm_nt(m, n, k, 1.0, a.device(), b.device(), 0.0, c.device_mut())
                .unwrap(),
            Dev::Host(_) => {
                fits("a", m * k, a.len());
                fits("b", n * k, b.len());
                fits("c", m * n, c.len());
                let (a, b) = (a.to_vec(), b.to_vec());
                let mut out = vec![0.0f32; m * n];
                // SAFETY: a is m × k (row stride k), bᵀ is k × n read from b's n × k rows (row
                // stride 1, column stride k), out is m × n (row stride n): all in bounds above.
                unsafe {
                    matrixmultiply::sgemm(
                        m,
                        k,
                        n,
                        1.0,
                        a.as_ptr(),
                        k as isize,
                        1,
                        b.as_ptr(),
                        1,
                        k as isize,
                        0.0,
                        out.as_mut_ptr(),
                        n as isize,
                        1,
                    )
                };
                c.write(0, &out).unwrap();
            }
        }
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

/// `got` ≈ `want` element-wise: |got − want| ≤ 1e-4 · (1 + |want|), NaN where NaN.
pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    super::assert_within(got, want, 1e-4, what);
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
