//! The hand-written kernels as embedded in the crate (ARCHITECTURE.md §5; sources in `cuda/`, launch
//! parameters in [`abi`]).
//!
//! build.rs compiles `cuda/*.cu` with nvcc when it finds one, into one fatbin holding SASS for
//! sm_80 and sm_90 and compute_90 PTX, embedded here ([`KernelImage::Fatbin`]). Without nvcc the
//! crate still builds: [`image`] is then [`KernelImage::Sources`] and the kernels are compiled
//! with NVRTC at first use — [`nvrtc_program`] is the whole program as one self-contained
//! translation unit, the same one nvcc compiles. The sources are embedded in every build, so a
//! device the fatbin cannot serve (older than sm_80, or a driver too old for its PTX) can still
//! fall back to NVRTC.
//!
//! Every kernel is `extern "C"` (its name below is its symbol), takes one argument — its
//! parameter struct from [`abi`], by value — and, except [`SIGNAL`] (one thread), runs
//! with blocks of [`BLOCK`] threads and any grid size (see `cuda/serve_kernels.h`).

use super::abi;

/// `serve_signal` ([`abi::SignalParams`]): grid 1, block 1.
pub const SIGNAL: &str = "serve_signal";
/// `serve_embedding_gather` ([`abi::EmbeddingParams`]): a warp per row.
pub const EMBEDDING_GATHER: &str = "serve_embedding_gather";
/// `serve_lstm_gather` ([`abi::LstmGatherParams`]): a thread per element of `[x | h]`.
pub const LSTM_GATHER: &str = "serve_lstm_gather";
/// `serve_lstm_pointwise` ([`abi::LstmPointwiseParams`]): a thread per (row, unit).
pub const LSTM_POINTWISE: &str = "serve_lstm_pointwise";
/// `serve_argmax` ([`abi::ArgmaxParams`]): a block per row.
pub const ARGMAX: &str = "serve_argmax";
/// `serve_tree_gather` ([`abi::TreeGatherParams`]): a thread per (row, unit).
pub const TREE_GATHER: &str = "serve_tree_gather";
/// `serve_tree_pointwise` ([`abi::TreePointwiseParams`]): a thread per (row, unit).
pub const TREE_POINTWISE: &str = "serve_tree_pointwise";
/// `serve_bias_act` ([`abi::BiasActParams`]): a thread per element.
pub const BIAS_ACT: &str = "serve_bias_act";
/// `serve_im2col` ([`abi::Im2colParams`]): a thread per element of the patches.
pub const IM2COL: &str = "serve_im2col";
/// `serve_chw_to_hwc` ([`abi::ChwToHwcParams`]): a thread per element.
pub const CHW_TO_HWC: &str = "serve_chw_to_hwc";
/// `serve_max_pool` ([`abi::MaxPoolParams`]): a thread per output element.
pub const MAX_POOL: &str = "serve_max_pool";
/// `serve_avg_pool` ([`abi::AvgPoolParams`]): a thread per (image, channel).
pub const AVG_POOL: &str = "serve_avg_pool";
/// `serve_add_relu` ([`abi::AddReluParams`]): a thread per element.
pub const ADD_RELU: &str = "serve_add_relu";
/// `serve_layer_norm` ([`abi::LayerNormParams`]): a block per row.
pub const LAYER_NORM: &str = "serve_layer_norm";
/// `serve_attention` ([`abi::AttentionParams`]): a block per (token, head).
pub const ATTENTION: &str = "serve_attention";
/// `serve_bert_embed` ([`abi::BertEmbedParams`]): a thread per element.
pub const BERT_EMBED: &str = "serve_bert_embed";

/// Every kernel of the image.
pub const KERNELS: [&str; 16] = [
    SIGNAL,
    EMBEDDING_GATHER,
    LSTM_GATHER,
    LSTM_POINTWISE,
    ARGMAX,
    TREE_GATHER,
    TREE_POINTWISE,
    BIAS_ACT,
    IM2COL,
    CHW_TO_HWC,
    MAX_POOL,
    AVG_POOL,
    ADD_RELU,
    LAYER_NORM,
    ATTENTION,
    BERT_EMBED,
];

/// Threads per block of every kernel but [`SIGNAL`].
pub const BLOCK: u32 = abi::SERVE_BLOCK;

/// The name NVRTC gives the program (it appears in its error messages).
pub const PROGRAM_NAME: &str = "serve_kernels.cu";

/// NVRTC options for [`nvrtc_program`], besides the target architecture
/// (`--gpu-architecture=sm_XY`; the kernels need sm_70 or newer).
pub const NVRTC_OPTIONS: &[&str] = &["-std=c++17"];

/// The files of `cuda/`, by name: headers first, then the kernel sources in compile order.
pub static SOURCES: &[(&str, &str)] = &[
    ("serve_kernels.h", include_str!("../../../cuda/serve_kernels.h")),
    ("serve_device.cuh", include_str!("../../../cuda/serve_device.cuh")),
    ("signal.cu", include_str!("../../../cuda/signal.cu")),
    ("embedding.cu", include_str!("../../../cuda/embedding.cu")),
    ("lstm.cu", include_str!("../../../cuda/lstm.cu")),
    ("dense.cu", include_str!("../../../cuda/dense.cu")),
    ("layers.cu", include_str!("../../../cuda/layers.cu")),
];

/// What the crate carries for the kernels.
#[derive(Clone, Copy, Debug)]
pub enum KernelImage {
    /// A fatbin from nvcc (8-byte aligned, for `cuModuleLoadData`).
    Fatbin(&'static [u8]),
    /// The sources ([`SOURCES`]), for NVRTC ([`nvrtc_program`]).
    Sources(&'static [(&'static str, &'static str)]),
}

/// Bytes aligned for the driver, which reads the fatbin header's 64-bit fields in place.
#[cfg(serve_fatbin)]
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

#[cfg(serve_fatbin)]
static FATBIN: &Aligned<[u8]> = &Aligned(*include_bytes!(env!("SERVE_KERNELS_FATBIN")));

/// The embedded fatbin, if build.rs found nvcc.
pub fn fatbin() -> Option<&'static [u8]> {
    #[cfg(serve_fatbin)]
    return Some(&FATBIN.0);
    #[cfg(not(serve_fatbin))]
    None
}

/// The kernels as built into this crate: the fatbin when there is one, else the sources.
pub fn image() -> KernelImage {
    match fatbin() {
        Some(f) => KernelImage::Fatbin(f),
        None => KernelImage::Sources(SOURCES),
    }
}

/// The whole program as one self-contained translation unit for NVRTC: the kernel sources one
/// after the other, each quoted `#include` of a file of [`SOURCES`] replaced by that file (once;
/// the headers have include guards), with `#line` markers so NVRTC's messages name the files.
pub fn nvrtc_program() -> String {
    nvrtc_program_of(SOURCES)
}

/// [`nvrtc_program`] over other files than [`SOURCES`] (same shape: `(file name, text)`; the
/// `.cu` files are the translation units, in order), e.g. a deliberately broken copy in a test.
pub fn nvrtc_program_of(sources: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut seen = Vec::new();
    for (name, _) in sources.iter().filter(|(n, _)| n.ends_with(".cu")) {
        inline(sources, name, &mut seen, &mut out);
    }
    out
}

fn inline<'a>(sources: &[(&'a str, &'a str)], name: &str, seen: &mut Vec<&'a str>, out: &mut String) {
    let Some(&(name, text)) = sources.iter().find(|(n, _)| *n == name) else { return };
    if seen.contains(&name) {
        return;
    }
    seen.push(name);
    out.push_str(&format!("#line 1 \"{name}\"\n"));
    for (i, line) in text.lines().enumerate() {
        let included = line
            .trim_start()
            .strip_prefix("#include")
            .map(str::trim)
            .and_then(|rest| rest.strip_prefix('"'))
            .and_then(|rest| rest.split('"').next())
            .and_then(|inc| sources.iter().find(|(n, _)| *n == inc).map(|(n, _)| *n));
        match included {
            Some(inc) => {
                inline(sources, inc, seen, out);
                out.push_str(&format!("#line {} \"{name}\"\n", i + 2));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// Blocks for `units` units of work at `per_block` units per block, for the grid-stride kernels:
/// at least 1, at most `2³¹ − 1` (the kernels loop over whatever one pass does not cover).
pub fn grid(units: u64, per_block: u32) -> u32 {
    units.div_ceil(u64::from(per_block.max(1))).clamp(1, i32::MAX as u64) as u32
}

/// What a fatbin entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FatbinKind {
    /// PTX for `compute_<arch>`.
    Ptx,
    /// A cubin (SASS) for `sm_<arch>`.
    Elf,
    Other(u16),
}

/// One entry of a fatbin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FatbinEntry {
    pub kind: FatbinKind,
    /// The architecture, e.g. 90 for sm_90 / compute_90.
    pub arch: u32,
    /// Bytes of the entry's payload as stored (compressed or not).
    pub size: u64,
}

/// The entries of a fatbin as nvcc writes it (`--fatbin`), or `None` if `bytes` is not one.
///
/// Layout (little-endian): a 16-byte header — magic `0xBA55ED50` (u32), version (u16), header
/// size (u16), size of what follows (u64) — then entries, each a header — kind (u16: 1 PTX,
/// 2 ELF), version (u16), header size (u32), payload size (u64), …, architecture (u32 at byte
/// 28) — followed by its payload.
pub fn fatbin_entries(bytes: &[u8]) -> Option<Vec<FatbinEntry>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(bytes.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    if u32_at(0)? != 0xBA55_ED50 {
        return None;
    }
    let header = usize::from(u16_at(6)?);
    let end = header.checked_add(usize::try_from(u64_at(8)?).ok()?)?;
    if end > bytes.len() {
        return None;
    }
    let mut entries = Vec::new();
    let mut at = header;
    while at < end {
        let kind = match u16_at(at)? {
            1 => FatbinKind::Ptx,
            2 => FatbinKind::Elf,
            k => FatbinKind::Other(k),
        };
        let head = usize::try_from(u32_at(at + 4)?).ok()?;
        let size = u64_at(at + 8)?;
        let arch = u32_at(at + 28)?;
        if head < 32 {
            return None;
        }
        entries.push(FatbinEntry { kind, arch, size });
        at = at.checked_add(head)?.checked_add(usize::try_from(size).ok()?)?;
    }
    (at == end).then_some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_an_extern_c_global_of_the_sources() {
        let program = nvrtc_program();
        for k in KERNELS {
            assert!(program.contains(&format!("SERVE_KERNEL {k}(")), "{k} is not defined in cuda/");
        }
        assert!(program.contains("#define SERVE_KERNEL extern \"C\" __global__"));
    }

    #[test]
    fn nvrtc_program_is_self_contained() {
        let program = nvrtc_program();
        let quoted: Vec<&str> =
            program.lines().filter(|l| l.trim_start().starts_with("#include \"")).collect();
        assert!(quoted.is_empty(), "quoted includes left for NVRTC: {quoted:?}");
        // Each file once.
        for (name, _) in SOURCES {
            assert_eq!(program.matches(&format!("#line 1 \"{name}\"")).count(), 1, "{name} inlined once");
        }
        // The only angle-bracket include is the guarded <cuda/atomic>.
        let angled: Vec<&str> = program
            .lines()
            .filter(|l| l.trim_start().starts_with("#include <"))
            .filter(|l| !l.contains("<stdint.h>") && !l.contains("<cuda/atomic>"))
            .collect();
        assert!(angled.is_empty(), "system includes NVRTC lacks: {angled:?}");
    }

    #[test]
    fn fatbin_parser_rejects_garbage() {
        assert_eq!(fatbin_entries(&[]), None);
        assert_eq!(fatbin_entries(&[0; 64]), None);
        let mut f = vec![0u8; 16];
        f[..4].copy_from_slice(&0xBA55_ED50u32.to_le_bytes());
        f[6] = 16;
        assert_eq!(fatbin_entries(&f), Some(vec![]));
        f[8] = 200; // claims more than there is
        assert_eq!(fatbin_entries(&f), None);
        // One PTX entry for compute_90 with a 4-byte payload.
        let mut f = vec![0u8; 16 + 64 + 4];
        f[..4].copy_from_slice(&0xBA55_ED50u32.to_le_bytes());
        f[6] = 16;
        f[8] = 68;
        f[16] = 1;
        f[20] = 64;
        f[24] = 4;
        f[44] = 90;
        assert_eq!(fatbin_entries(&f), Some(vec![FatbinEntry { kind: FatbinKind::Ptx, arch: 90, size: 4 }]));
    }

    #[test]
    fn grid_covers_and_clamps() {
        assert_eq!(grid(0, BLOCK), 1);
        assert_eq!(grid(1, BLOCK), 1);
        assert_eq!(grid(257, 256), 2);
        assert_eq!(grid(u64::MAX, 1), i32::MAX as u32);
        assert_eq!(grid(5, 0), 5);
    }
}
