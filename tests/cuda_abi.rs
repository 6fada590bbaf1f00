//! The kernels' launch-parameter ABI: the committed Rust mirror `src/backend/cuda/abi.rs` must be
//! exactly what bindgen (pinned by Cargo.lock) generates from `cuda/serve_kernels.h`.
//! `SERVE_UPDATE_ABI=1 cargo test --test cuda_abi` rewrites it.
//!
//! bindgen needs libclang, opened when the test runs (bindgen's `runtime` feature: building the
//! test never needs it). Where no libclang is found the drift check prints
//! `skipped: libclang not found` and passes, unless `SERVE_REQUIRE_BINDGEN=1`, which makes that a
//! failure. CI (`.ci/run`) installs Debian's `libclang-dev` (`apt-get install -y libclang-dev`)
//! and sets `SERVE_REQUIRE_BINDGEN=1`, so every CI run checks for drift. Elsewhere: install
//! libclang from your distribution, or `pip install libclang` and point `LIBCLANG_PATH` at the
//! wheel's `clang/native` directory. The header only needs `<stdint.h>` from the C library.
//!
//! Also checks the kernel image the crate embeds: with `SERVE_REQUIRE_NVCC=1` (set by CI, which
//! also builds with it) it must be nvcc's fatbin with sm_80 and sm_90 SASS and compute_90 PTX.

use std::path::{Path, PathBuf};

use serve::backend::cuda::kernels::{self, FatbinKind, KernelImage};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// C names → Rust names: `serve_lstm_gather_params` → `LstmGatherParams`, `serve_dptr` →
/// `DevicePtr`; macros keep their names.
#[derive(Debug)]
struct Names;

impl bindgen::callbacks::ParseCallbacks for Names {
    fn item_name(&self, item: bindgen::callbacks::ItemInfo) -> Option<String> {
        let name = item.name.strip_prefix("serve_")?;
        if name == "dptr" {
            return Some("DevicePtr".into());
        }
        Some(
            name.split('_')
                .map(|w| {
                    let mut c = w.chars();
                    c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
                })
                .collect(),
        )
    }
}

const PREAMBLE: &str = "\
//! Launch parameters of the hand-written kernels (`cuda/serve_kernels.h`), mirrored by bindgen.
//!
//! Generated: do not edit. `SERVE_UPDATE_ABI=1 cargo test --test cuda_abi` regenerates it from the
//! header, and the same test fails when this file and the header differ (tests/cuda_abi.rs).
//! Names: `serve_<name>_params` is `<Name>Params`, `serve_dptr` is [`DevicePtr`] (a `CUdeviceptr`).

#[rustfmt::skip]
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, clippy::all, rustdoc::all)]
mod bindings {
";

const POSTAMBLE: &str = "}

pub use bindings::*;
";

/// The generated file, or `None` when libclang cannot be loaded.
fn generate() -> Option<String> {
    if let Err(e) = clang_sys::load() {
        eprintln!("libclang: {e}");
        return None;
    }
    let header = root().join("cuda/serve_kernels.h");
    let bindings = bindgen::Builder::default()
        .header(header.to_str().expect("UTF-8 path"))
        .clang_args(["-x", "c", "-std=c11", "-fparse-all-comments"])
        .allowlist_type("serve_.*")
        .allowlist_var("SERVE_.*")
        .derive_default(true)
        .derive_eq(true)
        .derive_hash(true)
        .layout_tests(true)
        .generate_comments(true)
        .parse_callbacks(Box::new(Names))
        .formatter(bindgen::Formatter::Prettyplease)
        .generate()
        .expect("bindgen generates the ABI mirror");
    Some(format!("{PREAMBLE}{bindings}{POSTAMBLE}"))
}

#[test]
fn abi_matches_generated() {
    let path = root().join("src/backend/cuda/abi.rs");
    let Some(fresh) = generate() else {
        assert!(
            std::env::var("SERVE_REQUIRE_BINDGEN").as_deref() != Ok("1"),
            "SERVE_REQUIRE_BINDGEN=1 but libclang could not be loaded (install libclang-dev or set LIBCLANG_PATH)"
        );
        println!("skipped: libclang not found");
        return;
    };
    if std::env::var_os("SERVE_UPDATE_ABI").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let line = committed.lines().zip(fresh.lines()).position(|(a, b)| a != b);
        panic!(
            "src/backend/cuda/abi.rs is stale (first difference at line {}): run \
             `SERVE_UPDATE_ABI=1 cargo test --test cuda_abi` and commit it",
            line.map_or(committed.lines().count().min(fresh.lines().count()), |l| l) + 1
        );
    }
}

/// The layouts the kernels assert in `cuda/serve_device.cuh` (and bindgen's own layout checks in
/// abi.rs assert against libclang's view of the header).
#[test]
fn abi_sizes_match_the_kernels_static_asserts() {
    use serve::backend::cuda::abi::*;
    use std::mem::size_of;
    let device = std::fs::read_to_string(root().join("cuda/serve_device.cuh")).unwrap();
    for (c, rust) in [
        ("serve_signal_params", size_of::<SignalParams>()),
        ("serve_embedding_params", size_of::<EmbeddingParams>()),
        ("serve_lstm_gather_params", size_of::<LstmGatherParams>()),
        ("serve_lstm_pointwise_params", size_of::<LstmPointwiseParams>()),
        ("serve_argmax_params", size_of::<ArgmaxParams>()),
        ("serve_tree_gather_params", size_of::<TreeGatherParams>()),
        ("serve_tree_pointwise_params", size_of::<TreePointwiseParams>()),
    ] {
        let want = format!("static_assert(sizeof({c}) == {rust},");
        assert!(device.contains(&want), "cuda/serve_device.cuh lacks `{want}`");
        assert_eq!(rust % 8, 0, "{c} is not a multiple of 8 bytes");
    }
    assert_eq!(size_of::<DevicePtr>(), 8);
    assert_eq!(SERVE_NO_TOKEN, u32::MAX, "the CPU backend's NO_TOKEN");
    assert_eq!(SERVE_ROW_FRESH & SERVE_SLOT_MASK, 0);
}

#[test]
fn kernel_image_is_complete() {
    let required = std::env::var("SERVE_REQUIRE_NVCC").as_deref() == Ok("1");
    match kernels::image() {
        KernelImage::Fatbin(f) => {
            assert_eq!(f.as_ptr() as usize % 8, 0, "the fatbin's alignment");
            let entries = kernels::fatbin_entries(f).expect("the embedded fatbin parses");
            for (kind, arch) in [(FatbinKind::Elf, 80), (FatbinKind::Elf, 90), (FatbinKind::Ptx, 90)] {
                assert!(
                    entries.iter().any(|e| e.kind == kind && e.arch == arch),
                    "no {kind:?} for {arch} in the fatbin: {entries:?}"
                );
            }
            println!("fatbin: {} bytes, {entries:?}", f.len());
        }
        KernelImage::Sources(s) => {
            assert!(!required, "SERVE_REQUIRE_NVCC=1 but the crate was built without a fatbin");
            let names: Vec<&str> = s.iter().map(|(n, _)| *n).collect();
            // Every kernel source (cuda/host/ is the host shim of the tests, not a kernel).
            for file in std::fs::read_dir(root().join("cuda")).unwrap() {
                let file = file.unwrap();
                if file.file_type().unwrap().is_dir() {
                    continue;
                }
                let name = file.file_name().into_string().unwrap();
                assert!(names.contains(&name.as_str()), "cuda/{name} is not embedded");
            }
            println!("no fatbin: {} sources embedded for NVRTC", s.len());
        }
    }
    assert!(Path::new(&root().join("cuda/serve_kernels.h")).is_file());
}
