//! The kernels' NVRTC fallback (ARCHITECTURE.md §5, src/backend/cuda/kernels.rs), compiled with no GPU.
//!
//! build.rs compiles `cuda/*.cu` with nvcc; without nvcc, or for a device the fatbin cannot serve,
//! the runtime compiles [`kernels::nvrtc_program`] with NVRTC at first use. NVRTC needs no GPU, so
//! these tests compile that program through the crate's own path ([`module::compile_for`], what
//! `module::compile` runs once it has picked the device's target) for sm_80 and sm_90 SASS and
//! compute_90 PTX — as the environment sets the include paths, and again with the CCCL headers
//! (signal.cu's `<cuda/atomic>` path) where they are found — check that every kernel the runtime
//! looks up is an entry point of each result, and that a broken kernel source fails with NVRTC's
//! log naming the file and line.
//!
//! NVRTC is found the way the runtime finds it ([`libs::nvrtc`]: cudarc's library names, so
//! `LD_LIBRARY_PATH` is honoured; CI installs the `nvidia-cuda-nvrtc` wheel and puts its
//! `nvidia/cu13/lib` there). Without it the tests print `skipped: no NVRTC library` and pass,
//! unless `SERVE_REQUIRE_NVRTC=1`, which makes a missing NVRTC a failure (CI sets it).

mod common;

use std::time::Instant;

use common::gpu::have_nvrtc;
use serve::backend::cuda::kernels;
use serve::backend::cuda::libs;
use serve::backend::cuda::module::{self, Target};
use serve::error::Code;

/// The sorted names of `KERNELS`.
fn wanted() -> Vec<String> {
    let mut names: Vec<String> = kernels::KERNELS.iter().map(|k| k.to_string()).collect();
    names.sort();
    names
}

/// The kernel entry points of NUL-terminated PTX text: the names of its `.entry` directives.
fn ptx_entries(ptx: &[u8]) -> Vec<String> {
    let text =
        std::str::from_utf8(ptx.strip_suffix(b"\0").expect("PTX is NUL-terminated")).expect("PTX text");
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_once(".entry ").map(|(_, rest)| rest))
        .map(|rest| rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string())
        .collect();
    names.sort();
    names
}

/// The kernel entry points of a cubin (ELF64, little-endian): the defined global functions of its
/// symbol table marked `STO_CUDA_ENTRY` (0x10 in `st_other`).
fn cubin_entries(elf: &[u8]) -> Vec<String> {
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&elf[..6], b"\x7fELF\x02\x01", "a little-endian ELF64 file");
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
    let section = |i: usize| shoff + i * shentsize;
    let mut names = Vec::new();
    for s in (0..shnum).map(section).filter(|&s| u32_at(s + 4) == 2) {
        // SHT_SYMTAB: sh_offset, sh_size, sh_link (its string table), sh_entsize.
        let (off, size, entsize) = (u64_at(s + 24), u64_at(s + 32), u64_at(s + 56));
        let strtab = u64_at(section(u32_at(s + 40)) + 24);
        for sym in (off..off + size).step_by(entsize) {
            let (info, other, shndx) = (elf[sym + 4], elf[sym + 5], u16_at(sym + 6));
            let (is_func, is_global) = (info & 0xf == 2, info >> 4 == 1);
            if is_func && is_global && shndx != 0 && other & 0x10 != 0 {
                let name = &elf[strtab + u32_at(sym)..];
                let name = &name[..name.iter().position(|&b| b == 0).expect("NUL-terminated name")];
                names.push(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    names.sort();
    names
}

/// Compile the kernels with NVRTC for each of `targets` with `options` besides
/// [`kernels::NVRTC_OPTIONS`]; check that each result's entry points are exactly the kernels the
/// runtime looks up ([`kernels::KERNELS`]) and that the PTX's `serve_signal` publishes with a
/// system-scope release. Prints each compile's time.
fn compile_and_check(options: &[&str], targets: &[Target]) {
    let program = kernels::nvrtc_program();
    let sources = [(kernels::PROGRAM_NAME, program.as_str())];
    let options: Vec<&str> = kernels::NVRTC_OPTIONS.iter().chain(options).copied().collect();
    for &target in targets {
        let start = Instant::now();
        let units = module::compile_for(&sources, &options, target)
            .unwrap_or_else(|e| panic!("the kernels do not compile with NVRTC for {target}: {e}"));
        println!("{target}: {:.2?}, {} bytes", start.elapsed(), units[0].image.len());
        assert_eq!(units.len(), 1, "one translation unit");
        assert_eq!(units[0].name, kernels::PROGRAM_NAME);
        assert_eq!(units[0].target, target.to_string());
        let image = &units[0].image;
        let entries = match target {
            Target::Sass(_) => cubin_entries(image),
            Target::Ptx(arch) => {
                let text = String::from_utf8_lossy(image);
                assert!(text.contains(&format!("\n.target sm_{arch}")), "PTX for compute_{arch}");
                let signal =
                    text.split(&format!(".entry {}(", kernels::SIGNAL)).nth(1).expect("serve_signal");
                let signal = &signal[..signal.find("\n}").expect("the end of serve_signal")];
                assert!(
                    signal.contains(".release.sys."),
                    "serve_signal without a release.sys RMW:\n{signal}"
                );
                ptx_entries(image)
            }
        };
        assert_eq!(entries, wanted(), "the {target}'s kernels are not the ones the runtime looks up");
    }
}

/// As the runtime compiles the kernels in this environment: include paths from
/// `SERVE_NVRTC_INCLUDE`, `CUDA_HOME`, `CUDA_PATH` (in CI none of them, so signal.cu's fallback
/// without libcu++).
#[test]
fn the_kernels_compile_with_nvrtc_for_sm_80_sm_90_and_compute_90() {
    if !have_nvrtc(false) {
        return;
    }
    let (major, minor) = module::nvrtc_version().unwrap();
    let archs = module::supported_archs().unwrap();
    println!("NVRTC {major}.{minor} ({}), archs {archs:?}", libs::nvrtc().unwrap().name());
    assert!(archs.contains(&80) && archs.contains(&90), "NVRTC {major}.{minor} supports only {archs:?}");
    compile_and_check(&[], &[Target::Sass(90), Target::Sass(80), Target::Ptx(90)]);
}

/// With the CCCL headers, so signal.cu takes its `<cuda/atomic>` path: those of the CUDA install
/// `NVCC` belongs to (`include/cccl` beside its `bin`: a toolkit, or the nvidia-cuda-nvcc and
/// nvidia-cuda-cccl wheels as CI installs them). Skipped without them, unless
/// `SERVE_REQUIRE_NVRTC=1` and `NVCC` is set.
#[test]
fn the_kernels_compile_with_nvrtc_and_the_cccl_headers() {
    if !have_nvrtc(false) {
        return;
    }
    let nvcc = std::env::var_os("NVCC").map(std::path::PathBuf::from);
    let cccl = nvcc.as_ref().and_then(|n| Some(n.parent()?.parent()?.join("include/cccl")));
    let Some(cccl) = cccl.filter(|d| d.join("cuda/atomic").is_file()) else {
        let why = format!("no CCCL headers (include/cccl/cuda/atomic) beside NVCC={nvcc:?}");
        if nvcc.is_some() && common::native::env_flag("SERVE_REQUIRE_NVRTC") {
            panic!("SERVE_REQUIRE_NVRTC=1 but {why}");
        }
        println!("skipped: {why}");
        return;
    };
    println!("CCCL headers: {}", cccl.display());
    let include = format!("--include-path={}", cccl.display());
    compile_and_check(&[&include], &[Target::Sass(90), Target::Ptx(90)]);
}

#[test]
fn a_broken_kernel_fails_with_the_nvrtc_log_naming_its_file_and_line() {
    if !have_nvrtc(false) {
        return;
    }
    // An undeclared identifier appended to the first statement of serve_lstm_pointwise in lstm.cu:
    // past lstm.cu's `#include`, so the line NVRTC reports is right only if the program's `#line`
    // markers restore the numbering after an inlined header.
    let (file, kernel, bad) = ("lstm.cu", kernels::LSTM_POINTWISE, "serve_nvrtc_test_undeclared");
    let text = kernels::SOURCES.iter().find(|(n, _)| *n == file).unwrap().1;
    let lines: Vec<&str> = text.lines().collect();
    let head = lines.iter().position(|l| l.starts_with(&format!("SERVE_KERNEL {kernel}("))).unwrap();
    let at = head + lines[head..].iter().position(|l| l.trim_end().ends_with(';')).unwrap();
    assert!(lines[..at].iter().any(|l| l.starts_with("#include \"")), "{file} includes a header first");
    let broken: String = lines
        .iter()
        .enumerate()
        .map(|(i, l)| if i == at { format!("{l} {bad};\n") } else { format!("{l}\n") })
        .collect();
    let sources: Vec<(&str, &str)> =
        kernels::SOURCES.iter().map(|&(n, t)| (n, if n == file { broken.as_str() } else { t })).collect();
    let program = kernels::nvrtc_program_of(&sources);

    let start = Instant::now();
    let e =
        module::compile_for(&[(kernels::PROGRAM_NAME, &program)], kernels::NVRTC_OPTIONS, Target::Sass(90))
            .unwrap_err();
    println!("broken program rejected in {:.2?}:\n{e}", start.elapsed());
    assert_eq!(e.code(), Code::Backend);
    let m = e.message();
    assert!(m.starts_with("NVRTC could not compile serve_kernels.cu for sm_90 cubin:\n"), "{m}");
    let line = at + 1;
    assert!(m.contains(&format!("{file}({line}): error")), "NVRTC's log does not name {file}({line}): {m}");
    assert!(m.contains(bad), "{m}");
}
