//! The CUDA layer (`src/backend/cuda`): devices, memory, streams, events, completion counters,
//! modules, cuBLAS.
//!
//! Tests that need a GPU ask [`device`] for one: with no CUDA device they print
//! `skipped: no CUDA device` and pass, unless `SERVE_REQUIRE_GPU=1`, which makes a missing device a
//! failure (ARCHITECTURE.md §9). Tests that also need NVRTC or cuBLAS skip the same way when that library
//! is missing (it is not part of the driver): with a message, or a failure under
//! `SERVE_REQUIRE_GPU=1`. The other tests run everywhere and check
//! that without CUDA nothing panics and every entry point answers `Unavailable` precisely.

mod common;

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gpu::{device, have_nvrtc, skip};
use serve::backend::CompletionSignal;
use serve::backend::cuda::kernels::{self, KernelImage};
use serve::backend::cuda::{self, CudaDevice, LaunchConfig, Module, Stream, driver, libs, module};
use serve::backend::{BackendChoice, BackendKind};
use serve::error::Code;

// ---------------------------------------------------------------------------------------------
// Everywhere (no GPU needed).

#[test]
fn probe_without_a_driver_finds_no_device_and_does_not_panic() {
    let p = cuda::probe_libs(&["libserve-test-no-such-driver.so.1"]);
    assert!(!p.driver_loaded);
    assert_eq!(p.devices, 0);
    assert_eq!(p.driver_version, None);
    assert!(p.device_info.is_empty());
    let reason = p.reason.as_deref().unwrap();
    assert!(reason.contains("no CUDA driver library (libserve-test-no-such-driver.so.1)"), "{reason}");
    assert_eq!(p.summary(), reason);

    // The real probe is consistent whatever this machine has.
    let p = cuda::probe();
    if p.devices == 0 {
        assert!(p.reason.is_some() && p.device_info.is_empty());
    } else if libs::driver().is_ok() {
        assert_eq!(p.device_info.len(), p.devices, "{:?}", p.info_error);
        assert!(p.summary().contains(&p.device_info[0].name));
    }
}

#[test]
fn library_checks_fail_with_unavailable_and_say_what_was_tried() {
    let names = vec!["libnvrtc-serve-test.so.13".to_string(), "libnvrtc-serve-test.so".to_string()];
    let e = libs::check_names("NVRTC", &names, libs::NVRTC_SYMBOLS).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(
        e.message(),
        "no NVRTC library could be loaded; tried libnvrtc-serve-test.so.13, libnvrtc-serve-test.so. \
         Install it or add its directory to LD_LIBRARY_PATH"
    );

    // A library that loads but lacks functions (libc, for a pretend cuBLAS).
    let e = libs::check_names("cuBLAS", &["libc.so.6".to_string()], libs::CUBLAS_SYMBOLS).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(
        e.message().starts_with("the cuBLAS library libc.so.6 lacks cublasCreate_v2, "),
        "{}",
        e.message()
    );

    // The real checks: whatever this machine has, an answer and never a panic; when missing, the
    // CUDA 13 soname is among the names tried.
    for (check, soname) in [
        (libs::driver as fn() -> serve::error::Result<&'static libs::Library>, "libcuda.so.1"),
        (libs::nvrtc, "libnvrtc.so.13"),
        (libs::cublas, "libcublas.so.13"),
    ] {
        match check() {
            Ok(lib) => {
                assert!(lib.name().starts_with(&soname[..soname.find('.').unwrap()]), "{}", lib.name())
            }
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable);
                assert!(e.message().contains(soname), "{}", e.message());
            }
        }
    }
}

#[test]
fn without_cuda_every_entry_point_is_unavailable() {
    if libs::driver().is_err() {
        for e in [
            CudaDevice::open(0).unwrap_err(),
            driver::device_count().unwrap_err(),
            driver::device_info(0).unwrap_err(),
            driver::driver_version().unwrap_err(),
        ] {
            assert_eq!(e.code(), Code::Unavailable, "{e}");
            assert!(e.message().contains("CUDA driver"), "{}", e.message());
        }
    }
    if libs::nvrtc().is_err() {
        let src = [("k.cu", "extern \"C\" __global__ void k() {}")];
        for e in [
            module::compile(&src, &[], (9, 0)).unwrap_err(),
            module::nvrtc_version().unwrap_err(),
            module::supported_archs().unwrap_err(),
        ] {
            assert_eq!(e.code(), Code::Unavailable, "{e}");
            assert!(e.message().contains("NVRTC"), "{}", e.message());
        }
    }
    // Without a device `auto` runs on the CPU and says why, and `cuda` explains itself; with one,
    // both are the CUDA backend.
    let auto = serve::backend::create(BackendChoice::Auto, 1).unwrap();
    let cuda = serve::backend::create(BackendChoice::Cuda, 1);
    if cuda::probe().devices == 0 {
        assert_eq!(auto.kind(), BackendKind::Cpu);
        assert!(auto.describe().contains("(CUDA not used: no CUDA device"), "{}", auto.describe());
        let e = cuda.err().unwrap();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.message().starts_with("no CUDA device"), "{}", e.message());
    } else {
        assert_eq!(auto.kind(), BackendKind::Cuda, "{}", auto.describe());
        assert_eq!(cuda.unwrap().kind(), BackendKind::Cuda);
    }
}

// ---------------------------------------------------------------------------------------------
// With a GPU.

#[test]
fn device_info_and_memory() {
    let Some(dev) = device() else { return };
    let info = dev.info();
    assert!(!info.name.is_empty());
    assert!(info.compute_capability >= (7, 0), "{info}");
    assert!(info.total_memory > 0 && info.multiprocessors > 0);
    assert!(info.can_map_host_memory && info.unified_addressing);
    let (free, total) = dev.memory().unwrap();
    assert!(free <= total && total == info.total_memory, "{free} {total} {info}");
    assert_eq!(cuda::probe().device_info.first(), Some(info));
    assert!(driver::driver_version().unwrap() >= 12000);

    let count = driver::device_count().unwrap();
    let e = CudaDevice::open(count).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.message().contains("does not exist"), "{}", e.message());
}

#[test]
fn device_buffer_round_trip() {
    let Some(dev) = device() else { return };
    let s = dev.stream().unwrap();
    let data: Vec<f32> = (0..10_000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut buf = s.upload(&data).unwrap();
    assert_eq!(buf.len(), data.len());
    assert_eq!(buf.bytes(), data.len() * 4);
    assert_eq!(s.download(&buf).unwrap(), data);

    // Partial copies at offsets.
    s.upload_into(&mut buf, 100, &[1.0, 2.0, 3.0]).unwrap();
    let mut part = [0f32; 5];
    s.download_into(&buf, 99, &mut part).unwrap();
    assert_eq!(part, [data[99], 1.0, 2.0, 3.0, data[103]]);

    // Device-to-device copy, then zeroing, ordered on the stream.
    let mut other = dev.alloc::<f32>(data.len()).unwrap();
    s.copy(&buf, 0, &mut other, 0, data.len()).unwrap();
    s.zero(&mut buf).unwrap();
    assert!(s.download(&buf).unwrap().iter().all(|&v| v == 0.0));
    let copied = s.download(&other).unwrap();
    assert_eq!(&copied[..99], &data[..99]);
    assert_eq!(&copied[100..103], &[1.0, 2.0, 3.0]);

    // Out-of-range requests are errors, not stray accesses.
    let e = s.upload_into(&mut buf, data.len() - 1, &[1.0, 2.0]).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("outside a buffer of 10000"), "{}", e.message());
    assert_eq!(s.download_into(&buf, usize::MAX, &mut part).unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(s.copy(&buf, 1, &mut other, 0, data.len()).unwrap_err().code(), Code::InvalidArgument);

    // Empty buffers own nothing and copy nothing.
    let empty = s.upload::<u32>(&[]).unwrap();
    assert!(empty.is_empty());
    assert!(s.download(&empty).unwrap().is_empty());

    // Integer types and arrays of them round-trip bit for bit.
    let words: Vec<[u32; 3]> = (0..1000u32).map(|i| [i, !i, i.rotate_left(7)]).collect();
    assert_eq!(s.download(&s.upload(&words).unwrap()).unwrap(), words);
}

#[test]
fn pinned_mapped_counters_are_read_by_acquire_loads() {
    let Some(dev) = device() else { return };
    let counters = dev.signal_counters(3).unwrap();
    assert_eq!(counters.len(), 3);
    for i in 0..3 {
        assert_eq!(counters.completed(i), 0, "counters start at zero");
        assert_eq!(counters.device_ptr(i) % 64, 0, "one counter per 64-byte line");
    }
    let sig: Arc<dyn CompletionSignal> = counters.signal(1);

    // A host-side release store is seen by the acquire load.
    counters.store(1, 41);
    assert_eq!(sig.completed(), 41);

    // A device write through the mapped address (a memset of the low and high words) is seen
    // once the stream is done, and touches no other counter.
    let s = dev.stream().unwrap();
    // SAFETY: two 4-byte-aligned words of counter 2's line, mapped memory of this context, kept
    // alive by `counters`; the host reads it only after the synchronize below.
    unsafe {
        s.memset_d32(counters.device_ptr(2), 7, 1).unwrap();
        s.memset_d32(counters.device_ptr(2) + 4, 1, 1).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(counters.completed(2), (1u64 << 32) | 7);
    assert_eq!(counters.completed(0), 0);
    assert_eq!(sig.completed(), 41);

    // The generic pinned buffer: host writes and reads, device reads through its address.
    let mut table = dev.pinned_mapped::<f32>(1024).unwrap();
    assert!(table.to_vec().iter().all(|&v| v == 0.0));
    let row: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    table.write(0, &row).unwrap();
    let mut back = [0f32; 4];
    table.read(1020, &mut back).unwrap();
    assert_eq!(back, [1020.0, 1021.0, 1022.0, 1023.0]);
    assert_eq!(table.write(1023, &[1.0, 2.0]).unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(table.device_ptr(), table.host_ptr() as u64, "UVA: one address for host and device");
}

#[test]
fn stream_ordering_with_events() {
    let Some(dev) = device() else { return };
    let (a, b) = (dev.stream().unwrap(), dev.stream().unwrap());
    let n = 16 << 20; // 64 MiB of u32: long enough for a missing dependency to show
    let x = dev.alloc::<u32>(n).unwrap();
    let mut y = dev.alloc::<u32>(n).unwrap();
    let done = dev.event().unwrap();
    for pattern in [0xABCD_0123u32, 0x1234_5678, 0] {
        // SAFETY: all of `x`, alive until the end of the test (its drop waits for the device);
        // the host does not touch it.
        unsafe { a.memset_d32(x.device_ptr(), pattern, n).unwrap() };
        a.record(&done).unwrap();
        b.wait(&done).unwrap(); // b's copy starts only after a's memset
        b.copy(&x, 0, &mut y, 0, n).unwrap();
        let got = b.download(&y).unwrap();
        assert!(got.iter().all(|&v| v == pattern), "pattern {pattern:#x}");
        done.synchronize().unwrap();
        assert!(done.query().unwrap());
    }

    // Timing events, where the driver can time them.
    let (start, end) = (dev.timing_event().unwrap(), dev.timing_event().unwrap());
    a.record(&start).unwrap();
    // SAFETY: as above.
    unsafe { a.memset_d32(x.device_ptr(), 1, n).unwrap() };
    a.record(&end).unwrap();
    match start.elapsed_ms(&end) {
        Ok(ms) => assert!(ms >= 0.0, "{ms}"),
        Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
    }
    assert_eq!(done.elapsed_ms(&end).unwrap_err().code(), Code::InvalidArgument);
}

/// The parameter struct of `serve_signal` (`serve_signal_params` in cuda/serve_kernels.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct SignalArgs {
    counter: u64,
}

#[test]
fn crate_kernels_load_and_the_signal_kernel_counts() {
    let Some(dev) = device() else { return };
    if matches!(kernels::image(), KernelImage::Sources(_)) && !have_nvrtc(true) {
        return; // no fatbin in this build and no NVRTC on this machine
    }
    let m = dev.kernels().unwrap();
    println!("kernels: {} ({})", m.describe(), m.unit_names().join(", "));
    assert!(Arc::ptr_eq(&m, &dev.kernels().unwrap()), "loaded once per device");
    for name in kernels::KERNELS {
        m.function(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let e = m.function("serve_no_such_kernel").unwrap_err();
    assert_eq!(e.code(), Code::Backend);
    assert!(e.message().contains("serve_no_such_kernel is not in the loaded module"), "{}", e.message());

    // Signal ordering on several streams with many tasks in flight: each stream's counter reaches
    // exactly its number of launches, read by acquire loads while the GPU runs (no synchronize).
    let signal = m.function(kernels::SIGNAL).unwrap();
    let streams: Vec<Stream> = (0..4).map(|_| dev.stream().unwrap()).collect();
    let counters = dev.signal_counters(streams.len()).unwrap();
    let per_stream = 1000u64;
    for round in 0..per_stream {
        for (i, s) in streams.iter().enumerate() {
            let args = SignalArgs { counter: counters.device_ptr(i) };
            // SAFETY: serve_signal takes one serve_signal_params {serve_dptr counter} by value; the
            // counter is mapped memory kept alive by `counters` until the end of the test, and the
            // host only does atomic loads of it meanwhile.
            unsafe { s.launch_with(&signal, LaunchConfig::linear(1, 1), &args).unwrap() };
            if round == 0 {
                assert!(counters.completed(i) <= 1);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = vec![0u64; streams.len()];
    while (0..streams.len()).any(|i| counters.completed(i) < per_stream) {
        for (i, l) in last.iter_mut().enumerate() {
            let now = counters.completed(i);
            assert!(now >= *l && now <= per_stream, "stream {i}: {l} then {now}");
            *l = now;
        }
        assert!(Instant::now() < deadline, "counters stuck at {last:?}");
        std::hint::spin_loop();
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    assert!((0..streams.len()).all(|i| counters.completed(i) == per_stream));
}

const TEST_HEADER: &str = r#"
#define TEST_KERNEL extern "C" __global__ void
typedef unsigned int u32;
typedef unsigned long long u64;
"#;

const TEST_KERNELS: &str = r#"
#include "test_kernels.cuh"
TEST_KERNEL fill_u32(u32 *p, u64 n, u32 v) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = v + (u32)i;
}
/* out[r][j] = table[rows[r]][j]: the zero-copy read of a host table. */
TEST_KERNEL gather_f32(const float *table, const u32 *rows, float *out, u32 width, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n * width; i += gridDim.x * blockDim.x)
        out[i] = table[(u64)rows[i / width] * width + i % width];
}
/* The signal protocol without libcu++: make prior writes visible system-wide, then store. */
TEST_KERNEL publish(float *data, u64 *counter, u64 v) {
    data[0] = 42.0f;
    __threadfence_system();
    *(volatile u64 *)counter = v;
}
"#;

#[test]
fn nvrtc_compiles_for_the_device_caches_and_reads_zero_copy_tables() {
    let Some(dev) = device() else { return };
    if !have_nvrtc(true) {
        return;
    }
    let (major, minor) = module::nvrtc_version().unwrap();
    println!("NVRTC {major}.{minor}, archs {:?}", module::supported_archs().unwrap());
    let files = [("test_kernels.cuh", TEST_HEADER), ("test_kernels.cu", TEST_KERNELS)];
    let m = dev.compile_module(&files, &["--std=c++17"]).unwrap();
    assert_eq!(m.unit_names(), ["test_kernels.cu"]);
    println!("test module: {}", m.describe());
    let cc = dev.info().compute_capability;
    assert!(Arc::ptr_eq(
        &module::compile(&files, &["--std=c++17"], cc).unwrap(),
        &module::compile(&files, &["--std=c++17"], cc).unwrap()
    ));

    let s = dev.stream().unwrap();
    // fill_u32 over a device buffer.
    let n = 100_000usize;
    let mut buf = dev.alloc::<u32>(n).unwrap();
    let fill = m.function("fill_u32").unwrap();
    let (mut p, mut len, mut v) = (buf.device_ptr(), n as u64, 1000u32);
    let mut args =
        [(&raw mut p).cast::<c_void>(), (&raw mut len).cast::<c_void>(), (&raw mut v).cast::<c_void>()];
    // SAFETY: fill_u32(u32*, u64, u32) with matching argument types; `buf` holds n u32 and
    // outlives the kernel (downloaded on the same stream below).
    unsafe { s.launch(&fill, LaunchConfig::linear(64, 256), &mut args).unwrap() };
    let got = s.download(&buf).unwrap();
    assert!(got.iter().enumerate().all(|(i, &x)| x == 1000 + i as u32));
    s.zero(&mut buf).unwrap();

    // Zero-copy gather from a pinned mapped table.
    let width = 64usize;
    let mut table = dev.pinned_mapped::<f32>(1000 * width).unwrap();
    let host: Vec<f32> = (0..1000 * width).map(|i| i as f32).collect();
    table.write(0, &host).unwrap();
    let rows: Vec<u32> = vec![999, 0, 5, 5, 123];
    let rows_dev = s.upload(&rows).unwrap();
    let out = dev.alloc::<f32>(rows.len() * width).unwrap();
    let gather = m.function("gather_f32").unwrap();
    let (mut t, mut r, mut o, mut w, mut nr) =
        (table.device_ptr(), rows_dev.device_ptr(), out.device_ptr(), width as u32, rows.len() as u32);
    let mut args = [
        (&raw mut t).cast::<c_void>(),
        (&raw mut r).cast::<c_void>(),
        (&raw mut o).cast::<c_void>(),
        (&raw mut w).cast::<c_void>(),
        (&raw mut nr).cast::<c_void>(),
    ];
    // SAFETY: gather_f32(const float*, const u32*, float*, u32, u32) with matching types; every
    // row id is < 1000 rows of the table; `out` holds rows × width floats; all three outlive the
    // kernel and the host does not touch them until the download on the same stream.
    unsafe { s.launch(&gather, LaunchConfig::linear(8, 256), &mut args).unwrap() };
    let got = s.download(&out).unwrap();
    for (k, &row) in rows.iter().enumerate() {
        assert_eq!(&got[k * width..(k + 1) * width], &host[row as usize * width..(row as usize + 1) * width]);
    }

    // A kernel's system-scope publish: once the acquire load sees the count, the data written
    // before it is there too.
    let counters = dev.signal_counters(1).unwrap();
    let mut data = dev.pinned_mapped::<f32>(1).unwrap();
    let publish = m.function("publish").unwrap();
    let (mut d, mut c, mut val) = (data.device_ptr(), counters.device_ptr(0), 7u64);
    let mut args =
        [(&raw mut d).cast::<c_void>(), (&raw mut c).cast::<c_void>(), (&raw mut val).cast::<c_void>()];
    // SAFETY: publish(float*, u64*, u64) with matching types; both addresses are mapped memory
    // alive until after the synchronize below; the host only loads the counter atomically and
    // reads `data` after seeing the count.
    unsafe { s.launch(&publish, LaunchConfig::linear(1, 1), &mut args).unwrap() };
    let deadline = Instant::now() + Duration::from_secs(30);
    while counters.completed(0) != 7 {
        assert!(Instant::now() < deadline, "the device's store never arrived");
        std::hint::spin_loop();
    }
    let mut seen = [0f32];
    data.read(0, &mut seen).unwrap();
    assert_eq!(seen, [42.0]);
    s.synchronize().unwrap();
    data.write(0, &[0.0]).unwrap();

    // The image path: NVRTC's cubin loaded as a prebuilt image; garbage refused before the driver.
    let units = module::compile(&files, &["--std=c++17"], cc).unwrap();
    // SAFETY: a complete cubin (or NUL-terminated PTX) just written by NVRTC.
    let from_image = unsafe { Module::load_image(&dev, "test cubin", &units[0].image) }.unwrap();
    from_image.function("fill_u32").unwrap();
    // SAFETY: the check before the driver rejects it (not a recognisable image).
    let e = unsafe { Module::load_image(&dev, "garbage", b"not an image") }.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // A compile error names the file and carries NVRTC's log.
    let bad = [("broken.cu", "extern \"C\" __global__ void k() { undeclared(); }")];
    let e = Module::compile(&dev, &bad, &[]).unwrap_err();
    assert_eq!(e.code(), Code::Backend);
    assert!(e.message().contains("could not compile broken.cu") && e.message().contains("undeclared"), "{e}");
}

#[test]
fn blas_gemm_nt_matches_the_cpu() {
    let Some(dev) = device() else { return };
    if let Err(e) = libs::cublas() {
        skip::<()>(&format!("no cuBLAS ({})", e.message()));
        return;
    }
    let s = dev.stream().unwrap();
    let mut blas = dev.blas(&s).unwrap();
    let (m, n, k) = (37usize, 129usize, 300usize);
    let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let b: Vec<f32> = (0..n * k).map(|i| ((i * 104_729) % 1000) as f32 / 500.0 - 1.0).collect();
    let c0: Vec<f32> = (0..m * n).map(|i| (i % 13) as f32).collect();
    let (da, db) = (s.upload(&a).unwrap(), s.upload(&b).unwrap());
    let mut dc = s.upload(&c0).unwrap();
    blas.gemm_nt(m, n, k, 1.5, &da, &db, 0.5, &mut dc).unwrap();
    let c = s.download(&dc).unwrap();
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| a[i * k + p] as f64 * b[j * k + p] as f64).sum();
            let want = 1.5 * dot + 0.5 * c0[i * n + j] as f64;
            let got = c[i * n + j] as f64;
            assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "C[{i}][{j}] = {got}, want {want}");
        }
    }
    let e = blas.gemm_nt(m + 1, n, k, 1.0, &da, &db, 0.0, &mut dc).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("A has"), "{}", e.message());
}

/// NVRTC needs no GPU: where its library is present (e.g. the `nvidia-cuda-nvrtc` wheel on
/// `LD_LIBRARY_PATH`), the test kernels compile through the layer's NVRTC path (to PTX for an
/// architecture NVRTC does not know), and a broken source fails with NVRTC's log.
#[test]
fn nvrtc_compiles_without_a_device() {
    if !have_nvrtc(false) {
        return;
    }
    // The crate's own kernels: tests/cuda_nvrtc.rs.
    let archs = module::supported_archs().unwrap();
    let files = [("test_kernels.cuh", TEST_HEADER), ("test_kernels.cu", TEST_KERNELS)];
    let units = module::compile(&files, &["--std=c++17"], (9, 0)).unwrap();
    assert_eq!(units.iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["test_kernels.cu"]);
    // An architecture NVRTC does not know compiles to PTX for the newest older one.
    let newest = *archs.iter().max().unwrap();
    let units = module::compile(&files, &[], (newest / 10 + 1, 0)).unwrap();
    assert_eq!(units[0].target, format!("compute_{newest} PTX"));
    assert!(units[0].image.ends_with(b"\0") && units[0].image.starts_with(b"//"), "NUL-terminated PTX");

    let bad = [("broken.cu", "extern \"C\" __global__ void k() { undeclared(); }")];
    let e = module::compile(&bad, &[], (9, 0)).unwrap_err();
    assert_eq!(e.code(), Code::Backend);
    assert!(e.message().starts_with("NVRTC could not compile broken.cu for sm_90 cubin:"), "{e}");
    assert!(e.message().contains("undeclared"), "{e}");
    let e = module::compile(&bad, &["--no-such-option"], (9, 0)).unwrap_err();
    assert_eq!(e.code(), Code::Backend);
    assert!(e.message().contains("nvrtcCompileProgram(broken.cu"), "{e}");
}
