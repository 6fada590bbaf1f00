//! The CUDA kernels run on the CPU (ARCHITECTURE.md §9, "GPU code verified on the host"):
//! `cuda/host/kernels_on_host.cpp` — the unchanged `cuda/*.cu` sources behind a shim of CUDA's
//! device language — built once per test process with the C++ compiler into a shared library,
//! loaded, and launched on host grids ([`HostKernels::launch`]); [`HostBuf`] is the memory those
//! launches address (host pointers stand in for device addresses: `serve_dptr` is 64 bits).
//!
//! A `HostBuf` has guard zones before and after its elements, filled with a canary pattern and
//! checked whenever its contents are read back and when it is dropped: a kernel writing out of
//! its buffer's bounds near either end fails the test that ran it.

use std::alloc::{Layout, alloc, dealloc};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::marker::PhantomData;
use std::path::Path;
use std::process::Command;
use std::ptr::NonNull;
use std::sync::OnceLock;

use serve::backend::cuda::{LaunchConfig, Pod, kernels};

use super::native::{CXX_COMPILER, run_compiler, scratch};

/// Guard elements on each side of a [`HostBuf`], and their byte pattern.
const GUARD_BYTES: usize = 256;
const CANARY: u8 = 0xA5;
/// The byte pattern of memory a launch has not written (`alloc`): every f32 a NaN, every u32
/// `0xFFFF_FFFF`, so that a kernel reading what nobody wrote shows.
pub const UNSET: u8 = 0xFF;

/// Host memory a host-emulated kernel can address, with canary-filled guard zones.
pub struct HostBuf<T: Pod> {
    base: NonNull<u8>,
    len: usize,
    _t: PhantomData<T>,
}

// SAFETY: a HostBuf owns its allocation, like a Vec<T> of Send + Sync elements (Pod: Send + Sync).
unsafe impl<T: Pod> Send for HostBuf<T> {}
// SAFETY: as above; shared access only reads.
unsafe impl<T: Pod> Sync for HostBuf<T> {}

impl<T: Pod> HostBuf<T> {
    fn layout(len: usize) -> Layout {
        let bytes =
            len.checked_mul(size_of::<T>()).and_then(|b| b.checked_add(2 * GUARD_BYTES)).expect("size");
        Layout::from_size_align(bytes, 64).expect("layout")
    }

    /// `len` elements, every byte `fill`.
    pub fn filled(len: usize, fill: u8) -> HostBuf<T> {
        let layout = Self::layout(len);
        // SAFETY: the layout's size is at least 2 · GUARD_BYTES > 0.
        let base = NonNull::new(unsafe { alloc(layout) }).expect("host memory");
        // SAFETY: the allocation holds `layout.size()` bytes.
        unsafe {
            std::ptr::write_bytes(base.as_ptr(), CANARY, layout.size());
            std::ptr::write_bytes(base.as_ptr().add(GUARD_BYTES), fill, len * size_of::<T>());
        }
        HostBuf { base, len, _t: PhantomData }
    }

    pub fn from_slice(v: &[T]) -> HostBuf<T> {
        let mut b = HostBuf::filled(v.len(), UNSET);
        b.write(0, v);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    fn elems(&self) -> *mut T {
        // SAFETY: GUARD_BYTES is inside the allocation; 64-byte alignment of the base and a guard
        // of a multiple of 64 bytes keep the elements aligned for T (size ≤ 8).
        unsafe { self.base.as_ptr().add(GUARD_BYTES).cast::<T>() }
    }

    /// The address kernels are given.
    pub fn addr(&self) -> u64 {
        self.elems() as u64
    }

    /// Write `src` at `offset` (the test's own host code, between launches).
    pub fn write(&mut self, offset: usize, src: &[T]) {
        assert!(offset.checked_add(src.len()).is_some_and(|end| end <= self.len), "write past the end");
        // SAFETY: in bounds (checked); `&mut self` means no launch is using the memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.elems().add(offset), src.len()) }
    }

    /// The elements, after checking both guard zones.
    pub fn to_vec(&self) -> Vec<T> {
        self.check_guards();
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: `len` initialised elements (every byte was written at creation; any bit
        // pattern is a valid Pod); no launch runs while the test reads.
        unsafe {
            std::ptr::copy_nonoverlapping(self.elems(), v.as_mut_ptr(), self.len);
            v.set_len(self.len);
        }
        v
    }

    /// Panic if a byte of either guard zone changed: something wrote outside the buffer.
    pub fn check_guards(&self) {
        let end = GUARD_BYTES + self.len * size_of::<T>();
        // SAFETY: both zones are inside the allocation.
        let (before, after) = unsafe {
            (
                std::slice::from_raw_parts(self.base.as_ptr(), GUARD_BYTES),
                std::slice::from_raw_parts(self.base.as_ptr().add(end), GUARD_BYTES),
            )
        };
        if let Some(i) = before.iter().position(|&b| b != CANARY) {
            panic!("a kernel wrote {} bytes before a buffer of {} elements", GUARD_BYTES - i, self.len);
        }
        if let Some(i) = after.iter().position(|&b| b != CANARY) {
            panic!("a kernel wrote at byte {i} past the end of a buffer of {} elements", self.len);
        }
    }
}

impl<T: Pod> Drop for HostBuf<T> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.check_guards();
        }
        // SAFETY: allocated in `filled` with this layout.
        unsafe { dealloc(self.base.as_ptr(), Self::layout(self.len)) }
    }
}

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, *const c_void, usize) -> c_int;
type KernelFn = unsafe extern "C" fn(usize) -> *const c_char;

/// The kernels built for the host, loaded.
pub struct HostKernels {
    launch: LaunchFn,
    /// Keeps the library (and so `launch`) loaded for the process.
    _lib: libloading::Library,
}

impl HostKernels {
    /// The library of this test process, built on first use; `None` when there is no C++
    /// compiler and `SERVE_SKIP_CPP=1` says to skip (without it, a missing compiler fails).
    pub fn get() -> Option<&'static HostKernels> {
        static LIB: OnceLock<Option<HostKernels>> = OnceLock::new();
        LIB.get_or_init(|| CXX_COMPILER.available().then(HostKernels::build)).as_ref()
    }

    fn build() -> HostKernels {
        let root = super::native::manifest_dir();
        let dir = scratch("kernels-on-host");
        let lib = dir.join("libserve_kernels_on_host.so");
        let mut cmd = Command::new(CXX_COMPILER.program());
        cmd.args(["-std=c++20", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread"])
            .arg(root.join("cuda/host/kernels_on_host.cpp"))
            .arg("-o")
            .arg(&lib);
        run_compiler(&mut cmd, "building the CUDA kernels for the host");
        Self::load(&lib)
    }

    fn load(path: &Path) -> HostKernels {
        // SAFETY: the library was just built from this repository's sources; loading it runs no
        // initialisers beyond the C++ runtime's.
        let lib =
            unsafe { libloading::Library::new(path) }.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // SAFETY: both symbols are defined in kernels_on_host.cpp with exactly these C signatures.
        let (launch, kernel) = unsafe {
            (
                *lib.get::<LaunchFn>(b"serve_host_launch\0").expect("serve_host_launch"),
                *lib.get::<KernelFn>(b"serve_host_kernel\0").expect("serve_host_kernel"),
            )
        };
        // Every kernel the runtime launches is emulated.
        let mut names = Vec::new();
        for i in 0.. {
            // SAFETY: serve_host_kernel returns a static NUL-terminated string or null.
            let p = unsafe { kernel(i) };
            if p.is_null() {
                break;
            }
            // SAFETY: non-null: a static C string.
            names.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
        for k in kernels::KERNELS {
            assert!(names.iter().any(|n| n == k), "kernel {k} is not in the host launch table: {names:?}");
        }
        HostKernels { launch, _lib: lib }
    }

    /// Run `kernel` on a host grid of `cfg`'s 1-D shape with `params` as its parameter struct.
    ///
    /// # Safety
    /// `P` must be the kernel's parameter struct (its size is checked by the library), and every
    /// address in it must be host memory (a [`HostBuf`]) holding what the kernel's contract in
    /// `cuda/serve_kernels.h` reads and writes, not accessed by anything else during the call.
    pub unsafe fn launch<P: Copy>(&self, kernel: &str, cfg: LaunchConfig, params: &P) {
        assert_eq!((cfg.grid.1, cfg.grid.2, cfg.block.1, cfg.block.2), (1, 1, 1, 1), "1-D launches only");
        let name = CString::new(kernel).expect("a kernel name");
        // SAFETY: forwarded contract; the library copies `*params` (size checked) and runs the
        // kernel before returning.
        let rc = unsafe {
            (self.launch)(name.as_ptr(), cfg.grid.0, cfg.block.0, (params as *const P).cast(), size_of::<P>())
        };
        assert_eq!(
            rc,
            0,
            "serve_host_launch({kernel}): {}",
            match rc {
                1 => "unknown kernel",
                2 => "parameter size mismatch",
                3 => "empty grid or block",
                _ => "?",
            }
        );
    }
}
