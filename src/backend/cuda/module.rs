//! Kernel modules: a prebuilt image loaded as is, or CUDA C++ sources compiled with NVRTC.
//!
//! build.rs embeds either a fatbin (nvcc was found: SASS for sm_80 / sm_90 plus compute_90 PTX) or
//! the kernel sources (no nvcc). Sources are compiled at first use for the device's compute
//! capability — to SASS (a cubin) when NVRTC knows the architecture, else to PTX for the newest
//! architecture it knows, which the driver JIT-compiles — and the result is cached for the process,
//! so every later device of the same capability loads it without compiling.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int};
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, sys as cusys};
use cudarc::nvrtc::result::NvrtcError;
use cudarc::nvrtc::sys as nv;

use super::driver::{CudaDevice, bind, check, driver_error};
use super::kernels::{self, KernelImage};
use super::libs;
use crate::error::{Code, Error, Result};

/// One `CUmodule`, unloaded on drop.
struct LoadedModule {
    raw: cusys::CUmodule,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUmodule is an opaque driver handle, valid on any thread (the driver API is
// thread-safe) and never changed after loading; it is unloaded exactly once, in Drop.
unsafe impl Send for LoadedModule {}
// SAFETY: as above: shared use only looks functions up.
unsafe impl Sync for LoadedModule {}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `raw` was loaded in this context and is unloaded only here; every Function
        // holds an Arc of this module, so none outlives it.
        self.ctx.record_err(unsafe { cu::module::unload(self.raw) });
    }
}

/// Kernels loaded into one device's context. [`Module::function`] looks a kernel up by name in
/// every unit.
pub struct Module {
    units: Vec<(String, Arc<LoadedModule>)>,
    ctx: Arc<CudaContext>,
    how: String,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("units", &self.unit_names()).field("how", &self.how).finish()
    }
}

impl Module {
    /// Load a prebuilt image (a fatbin, a cubin, or NUL-terminated PTX) with `cuModuleLoadData`.
    ///
    /// # Safety
    /// `image` must be one complete, well-formed image of one of those kinds, as nvcc or NVRTC
    /// wrote it: the driver parses it with no length bound and trusts its internal sizes. (The
    /// obvious mistakes — no recognisable image, a fatbin or ELF header claiming more bytes than
    /// `image` has, PTX without its NUL — are caught and reported.)
    pub unsafe fn load_image(device: &CudaDevice, what: &str, image: &[u8]) -> Result<Module> {
        check_image(what, image)?;
        let ctx = device.context().clone();
        // SAFETY: forwarded contract.
        let m = unsafe { load_unit(&ctx, what, image) }?;
        Ok(Module { units: vec![(what.to_string(), m)], ctx, how: format!("{what} ({} bytes)", image.len()) })
    }

    /// Compile CUDA C++ sources with NVRTC for this device ([`compile`], cached per process) and
    /// load them. `files` are `(file name, text)`: names ending in `.h`, `.cuh` or `.hpp` are
    /// headers that every other file may `#include "name"`; every other file is a translation
    /// unit, compiled on its own and loaded as a unit of its own. `options` go to NVRTC besides
    /// the target architecture (chosen here) and include paths.
    pub fn compile(device: &CudaDevice, files: &[(&str, &str)], options: &[&str]) -> Result<Module> {
        let compiled = compile(files, options, device.info().compute_capability)?;
        let ctx = device.context().clone();
        let mut units = Vec::with_capacity(compiled.len());
        for c in compiled.iter() {
            // SAFETY: NVRTC's own output: a complete cubin, or PTX with its NUL (`Program::output`).
            units.push((c.name.clone(), unsafe { load_unit(&ctx, &c.name, &c.image) }?));
        }
        let how = compiled.first().map(|c| format!("NVRTC, {}", c.target)).unwrap_or_default();
        Ok(Module { units, ctx, how })
    }

    /// The loaded units (source file names, or the image's name).
    pub fn unit_names(&self) -> Vec<&str> {
        self.units.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// How the module was built: "embedded fatbin (123456 bytes)" or "NVRTC, sm_90 cubin".
    pub fn describe(&self) -> &str {
        &self.how
    }

    /// The kernel `name` (an `extern "C"` name).
    pub fn function(&self, name: &str) -> Result<Function> {
        let c_name =
            CString::new(name).map_err(|_| Error::invalid(format!("kernel name {name:?} contains NUL")))?;
        for (_, m) in &self.units {
            // SAFETY: a loaded module of this context; `c_name` is NUL-terminated and outlives the
            // call. cuModuleGetFunction needs no current context.
            match unsafe { cu::module::get_function(m.raw, c_name.clone()) } {
                Ok(raw) => {
                    return Ok(Function {
                        raw,
                        module: m.clone(),
                        ctx: self.ctx.clone(),
                        name: name.to_string(),
                    });
                }
                Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_FOUND => continue,
                Err(e) => return Err(driver_error(&format!("cuModuleGetFunction({name})"), e)),
            }
        }
        Err(Error::new(
            Code::Backend,
            format!("kernel {name} is not in the loaded module ({})", self.unit_names().join(", ")),
        ))
    }
}

/// Catch images that are certainly not loadable before the driver parses them unbounded.
fn check_image(what: &str, image: &[u8]) -> Result<()> {
    let bad = |why: &str| Err(Error::invalid(format!("{what} is not a loadable CUDA image: {why}")));
    let u16_at = |o: usize| image.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as u64);
    let u64_at = |o: usize| image.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    if image.starts_with(&0xBA55_ED50u32.to_le_bytes()) {
        // A fatbin: header size (u16 at 6) plus payload size (u64 at 8).
        if kernels::fatbin_entries(image).is_none() {
            return bad("a fatbin whose sizes exceed the image");
        }
    } else if image.starts_with(b"\x7fELF") {
        // A cubin (ELF64): section headers at e_shoff (u64 at 40), e_shentsize·e_shnum (u16s at
        // 58, 60) must lie inside the image.
        let end = match (u64_at(40), u16_at(58), u16_at(60)) {
            (Some(off), Some(size), Some(n)) => off.checked_add(size * n),
            _ => None,
        };
        if image.get(4) != Some(&2) || end.is_none_or(|e| e > image.len() as u64) {
            return bad("a truncated or 32-bit ELF file");
        }
    } else if !image.contains(&0) {
        return bad("neither a fatbin nor a cubin, and not NUL-terminated PTX text");
    }
    Ok(())
}

/// Load one image into `ctx`.
///
/// # Safety
/// As [`Module::load_image`].
unsafe fn load_unit(ctx: &Arc<CudaContext>, what: &str, image: &[u8]) -> Result<Arc<LoadedModule>> {
    bind(ctx)?;
    // The driver reads 64-bit fields of fatbin and ELF headers in place: give it 8-byte alignment.
    let copy: Vec<u64>;
    let ptr = if image.as_ptr().align_offset(8) == 0 {
        image.as_ptr()
    } else {
        let mut words = vec![0u64; image.len().div_ceil(8)];
        // SAFETY: `words` has at least `image.len()` bytes; distinct allocations.
        unsafe {
            std::ptr::copy_nonoverlapping(image.as_ptr(), words.as_mut_ptr().cast::<u8>(), image.len())
        };
        copy = words;
        copy.as_ptr().cast::<u8>()
    };
    // SAFETY: `ptr` is the image (or an aligned copy), alive for the call; the caller vouches for
    // its well-formedness; the driver copies what it keeps. The context is current (bound).
    let raw = check(&format!("cuModuleLoadData({what})"), unsafe { cu::module::load_data(ptr.cast()) })?;
    Ok(Arc::new(LoadedModule { raw, ctx: ctx.clone() }))
}

/// Load the crate's kernels ([`kernels::image`]) into `device`: the fatbin as is, falling back to
/// NVRTC when the driver cannot use it for the device (no SASS or PTX it can run) and whenever the
/// build embedded only the sources. Use [`CudaDevice::kernels`], which loads once per device.
pub(crate) fn load_kernels(device: &CudaDevice) -> Result<Module> {
    let nvrtc = || {
        let program = kernels::nvrtc_program();
        Module::compile(device, &[(kernels::PROGRAM_NAME, program.as_str())], kernels::NVRTC_OPTIONS)
    };
    match kernels::image() {
        KernelImage::Fatbin(fatbin) => {
            // SAFETY: the fatbin nvcc wrote at build time, embedded whole (kernels.rs).
            match unsafe { Module::load_image(device, "embedded fatbin", fatbin) } {
                Ok(m) => Ok(m),
                Err(e) if e.code() == Code::Unavailable => nvrtc().map_err(|n| {
                    Error::new(
                        n.code(),
                        format!(
                            "the embedded fatbin does not fit {}: {e}; NVRTC fallback: {n}",
                            device.info()
                        ),
                    )
                }),
                Err(e) => Err(e),
            }
        }
        KernelImage::Sources(_) => nvrtc(),
    }
}

/// A kernel of a loaded [`Module`]; keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    raw: cusys::CUfunction,
    module: Arc<LoadedModule>,
    ctx: Arc<CudaContext>,
    name: String,
}

// SAFETY: a CUfunction is an opaque driver handle usable from any thread; `module` keeps it valid.
unsafe impl Send for Function {}
// SAFETY: as above; launching only reads the handle.
unsafe impl Sync for Function {}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Function({})", self.name)
    }
}

impl Function {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn raw(&self) -> cusys::CUfunction {
        debug_assert!(!self.module.raw.is_null());
        self.raw
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// One compiled translation unit.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The source's file name.
    pub name: String,
    /// "sm_90 cubin" or "compute_90 PTX".
    pub target: String,
    /// The cubin, or the NUL-terminated PTX text.
    pub image: Vec<u8>,
}

/// What NVRTC should produce for a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// SASS for exactly this architecture (e.g. 90), as a cubin.
    Sass(u32),
    /// PTX for this (older) virtual architecture; the driver compiles it for the device.
    Ptx(u32),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Sass(a) => write!(f, "sm_{a} cubin"),
            Target::Ptx(a) => write!(f, "compute_{a} PTX"),
        }
    }
}

/// The NVRTC target for a device of compute capability `cc` given the architectures NVRTC
/// supports (`nvrtcGetSupportedArchs`, e.g. `[75, 80, …, 90, …]`).
pub fn pick_target(cc: (u32, u32), supported: &[u32]) -> Result<Target> {
    let arch = cc.0 * 10 + cc.1;
    if supported.contains(&arch) {
        return Ok(Target::Sass(arch));
    }
    match supported.iter().copied().filter(|&a| a < arch).max() {
        Some(a) => Ok(Target::Ptx(a)),
        None => Err(Error::new(
            Code::Unavailable,
            format!(
                "NVRTC cannot compile for sm_{arch}: it supports {}",
                supported.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

fn is_header(name: &str) -> bool {
    name.ends_with(".h") || name.ends_with(".cuh") || name.ends_with(".hpp")
}

/// Include directories for NVRTC: `SERVE_NVRTC_INCLUDE` (`:`-separated), then `include` and
/// `include/cccl` (libcu++'s `<cuda/atomic>` in CUDA 13) under `CUDA_HOME` / `CUDA_PATH`.
/// Without them the kernels use their fallbacks (see `cuda/signal.cu`).
fn include_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = std::env::var("SERVE_NVRTC_INCLUDE")
        .map(|v| v.split(':').filter(|d| !d.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(root) = std::env::var(var) {
            for sub in ["include", "include/cccl"] {
                let d = std::path::Path::new(&root).join(sub);
                if d.is_dir() {
                    dirs.push(d.to_string_lossy().into_owned());
                }
            }
        }
    }
    dirs
}

type CacheKey = (Target, Vec<String>, Vec<(String, String)>);

/// Compile the translation units of `sources` (see [`Module::compile`]) with `options` for a
/// device of compute capability `cc` (the target is [`pick_target`]'s choice among
/// [`supported_archs`]); see [`compile_for`].
pub fn compile(sources: &[(&str, &str)], options: &[&str], cc: (u32, u32)) -> Result<Arc<Vec<Compiled>>> {
    let target = pick_target(cc, &supported_archs()?)?;
    compile_for(sources, options, target)
}

/// Compile the translation units of `sources` (see [`Module::compile`]) with `options` for
/// `target`, or return the result of an earlier identical compilation in this process. Needs
/// NVRTC only, no device. Include paths: `SERVE_NVRTC_INCLUDE` (`:`-separated), then `include`
/// and `include/cccl` under `CUDA_HOME` / `CUDA_PATH` when they exist.
pub fn compile_for(sources: &[(&str, &str)], options: &[&str], target: Target) -> Result<Arc<Vec<Compiled>>> {
    static CACHE: Mutex<Option<HashMap<CacheKey, Arc<Vec<Compiled>>>>> = Mutex::new(None);
    libs::nvrtc()?;
    if let Some(bad) = options.iter().find(|o| o.contains('\0')) {
        return Err(Error::invalid(format!("NVRTC option {bad:?} contains NUL")));
    }
    let mut options: Vec<String> = options.iter().map(|o| o.to_string()).collect();
    options.extend(include_dirs().iter().map(|d| format!("--include-path={d}")));
    options.push(match target {
        Target::Sass(a) => format!("--gpu-architecture=sm_{a}"),
        Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
    });
    let key: CacheKey =
        (target, options.clone(), sources.iter().map(|(n, s)| (n.to_string(), s.to_string())).collect());
    // Holding the lock while compiling makes concurrent first uses wait for one compilation.
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(hit) = cache.as_ref().and_then(|c| c.get(&key)) {
        return Ok(hit.clone());
    }
    let headers: Vec<(&str, &str)> = sources.iter().copied().filter(|(n, _)| is_header(n)).collect();
    let units: Vec<(&str, &str)> = sources.iter().copied().filter(|(n, _)| !is_header(n)).collect();
    if units.is_empty() {
        return Err(Error::invalid("no CUDA source to compile (only headers)"));
    }
    let compiled: Vec<Compiled> = units
        .iter()
        .map(|(name, src)| compile_one(name, src, &headers, &options, target))
        .collect::<Result<_>>()?;
    let compiled = Arc::new(compiled);
    cache.get_or_insert_with(HashMap::new).insert(key, compiled.clone());
    Ok(compiled)
}

fn nvrtc_error(call: &str, e: NvrtcError) -> Error {
    // SAFETY: nvrtcGetErrorString (a checked symbol) returns a static NUL-terminated string for
    // any status, or null.
    let p = unsafe { nv::nvrtcGetErrorString(e.0) };
    let what = if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null: a static NUL-terminated string owned by NVRTC.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Error::new(Code::Backend, format!("{call} failed: {:?} ({what})", e.0))
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    libs::nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers for the call's duration; the library was checked.
    let r = unsafe { nv::nvrtcVersion(&mut major, &mut minor) }.result();
    r.map_err(|e| nvrtc_error("nvrtcVersion", e))?;
    Ok((major, minor))
}

/// The real architectures NVRTC can compile for, e.g. `[75, 80, 86, 87, 88, 89, 90, …]`.
pub fn supported_archs() -> Result<Vec<u32>> {
    libs::nvrtc()?;
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer; the library was checked.
    let r = unsafe { nv::nvrtcGetNumSupportedArchs(&mut n) }.result();
    r.map_err(|e| nvrtc_error("nvrtcGetNumSupportedArchs", e))?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    // SAFETY: `archs` has room for the `n` entries NVRTC just said it will write.
    let r = unsafe { nv::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result();
    r.map_err(|e| nvrtc_error("nvrtcGetSupportedArchs", e))?;
    Ok(archs.into_iter().filter(|&a| a > 0).map(|a| a as u32).collect())
}

/// An NVRTC program, destroyed on drop. Keeps the C strings it was created from alive, since
/// NVRTC may refer to them until then.
struct Program {
    prog: nv::nvrtcProgram,
    _strings: Vec<CString>,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed only here. A failure
        // leaks the program; nothing else to do in drop.
        let _ = unsafe { nv::nvrtcDestroyProgram(&mut self.prog) };
    }
}

impl Program {
    fn create(name: &str, src: &str, headers: &[(&str, &str)]) -> Result<Program> {
        let c = |what: &str, s: &str| {
            CString::new(s).map_err(|_| Error::invalid(format!("{what} of {name} contains a NUL byte")))
        };
        let mut strings = vec![c("source", src)?, c("name", name)?];
        for (h, text) in headers {
            strings.push(c("header", text)?);
            strings.push(c("header name", h)?);
        }
        let contents: Vec<*const c_char> = (0..headers.len()).map(|h| strings[2 + 2 * h].as_ptr()).collect();
        let names: Vec<*const c_char> = (0..headers.len()).map(|h| strings[3 + 2 * h].as_ptr()).collect();
        let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer is a NUL-terminated string kept alive in `strings` for the
        // program's whole life (moved into the Program below; moving a CString does not move its
        // heap buffer); `contents` and `names` have `headers.len()` entries each.
        let r = unsafe {
            nv::nvrtcCreateProgram(
                &mut prog,
                strings[0].as_ptr(),
                strings[1].as_ptr(),
                headers.len() as c_int,
                contents.as_ptr(),
                names.as_ptr(),
            )
        }
        .result();
        r.map_err(|e| nvrtc_error(&format!("nvrtcCreateProgram({name})"), e))?;
        Ok(Program { prog, _strings: strings })
    }

    fn compile(&self, options: &[String]) -> std::result::Result<(), NvrtcError> {
        let options: Vec<CString> = options
            .iter()
            .map(|o| {
                CString::new(o.as_str()).expect("compile() rejects options with NUL; env values have none")
            })
            .collect();
        let ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: a live program; `ptrs` holds `len` NUL-terminated strings alive for the call.
        unsafe { nv::nvrtcCompileProgram(self.prog, ptrs.len() as c_int, ptrs.as_ptr()) }.result()
    }

    /// The compiler's log (warnings, errors), trimmed.
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        if unsafe { nv::nvrtcGetProgramLogSize(self.prog, &mut size) }.result().is_err() || size == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has the `size` bytes (NUL included) NVRTC said the log needs.
        if unsafe { nv::nvrtcGetProgramLog(self.prog, buf.as_mut_ptr().cast()) }.result().is_err() {
            return String::new();
        }
        String::from_utf8_lossy(&buf).trim_end_matches('\0').trim().to_string()
    }

    /// The compiled image: the cubin, or the PTX text with its NUL terminator.
    fn output(&self, target: Target) -> std::result::Result<Vec<u8>, (&'static str, NvrtcError)> {
        type SizeFn = unsafe fn(nv::nvrtcProgram, *mut usize) -> nv::nvrtcResult;
        type GetFn = unsafe fn(nv::nvrtcProgram, *mut c_char) -> nv::nvrtcResult;
        let (size_fn, get_fn, what): (SizeFn, GetFn, _) = match target {
            Target::Sass(_) => (nv::nvrtcGetCUBINSize, nv::nvrtcGetCUBIN, "nvrtcGetCUBIN"),
            Target::Ptx(_) => (nv::nvrtcGetPTXSize, nv::nvrtcGetPTX, "nvrtcGetPTX"),
        };
        let mut size = 0usize;
        // SAFETY: a live, compiled program and a valid out-pointer.
        unsafe { size_fn(self.prog, &mut size) }.result().map_err(|e| (what, e))?;
        let mut image = vec![0u8; size];
        // SAFETY: `image` has the `size` bytes NVRTC said the output needs.
        unsafe { get_fn(self.prog, image.as_mut_ptr().cast()) }.result().map_err(|e| (what, e))?;
        Ok(image)
    }
}

fn compile_one(
    name: &str,
    src: &str,
    headers: &[(&str, &str)],
    options: &[String],
    target: Target,
) -> Result<Compiled> {
    let prog = Program::create(name, src, headers)?;
    if let Err(e) = prog.compile(options) {
        let log = prog.log();
        return Err(if e.0 == nv::nvrtcResult::NVRTC_ERROR_COMPILATION {
            Error::new(Code::Backend, format!("NVRTC could not compile {name} for {target}:\n{log}"))
        } else {
            let err = nvrtc_error(&format!("nvrtcCompileProgram({name}, {})", options.join(" ")), e);
            if log.is_empty() { err } else { Error::new(err.code(), format!("{}\n{log}", err.message())) }
        });
    }
    let image = prog.output(target).map_err(|(call, e)| nvrtc_error(&format!("{call}({name})"), e))?;
    Ok(Compiled { name: name.to_string(), target: target.to_string(), image })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_is_sass_when_known_else_ptx_of_the_newest_older_arch() {
        let known = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(pick_target((9, 0), &known).unwrap(), Target::Sass(90));
        assert_eq!(pick_target((8, 7), &known).unwrap(), Target::Ptx(86));
        assert_eq!(pick_target((13, 0), &known).unwrap(), Target::Ptx(120));
        let e = pick_target((7, 0), &known).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.message().contains("cannot compile for sm_70"), "{}", e.message());
        assert_eq!(Target::Sass(90).to_string(), "sm_90 cubin");
        assert_eq!(Target::Ptx(90).to_string(), "compute_90 PTX");
    }

    #[test]
    fn images_the_driver_would_overrun_are_rejected_before_loading() {
        let bad = |image: &[u8]| check_image("test image", image).unwrap_err().message().to_string();
        assert!(bad(b"garbage without a terminator").contains("not NUL-terminated PTX text"));
        assert!(check_image("ptx", b".version 9.0\n.target sm_90\n\0").is_ok());
        // A fatbin header claiming 200 bytes after a 16-byte header, in a 16-byte image.
        let mut fatbin = vec![0u8; 16];
        fatbin[..4].copy_from_slice(&0xBA55_ED50u32.to_le_bytes());
        fatbin[6] = 16;
        assert!(check_image("fatbin", &fatbin).is_ok());
        fatbin[8] = 200;
        assert!(bad(&fatbin).contains("a fatbin whose sizes exceed the image"));
        // ELF64 with its section headers (e_shoff 64, 3 × 64 bytes) past the end.
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[40] = 64;
        elf[58] = 64;
        elf[60] = 3;
        assert!(bad(&elf).contains("truncated"));
        elf.resize(64 + 3 * 64, 0);
        assert!(check_image("elf", &elf).is_ok());
        elf[4] = 1; // ELF32
        assert!(bad(&elf).contains("32-bit"));
        assert_eq!(check_image("x", b"").unwrap_err().code(), Code::InvalidArgument);
    }

    #[test]
    fn without_nvrtc_compiling_is_unavailable_not_a_panic() {
        if libs::nvrtc().is_ok() {
            return; // NVRTC present: compiled for real in tests/cuda_layer.rs
        }
        let e = compile(&[("k.cu", "extern \"C\" __global__ void k() {}")], &[], (9, 0)).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.message().contains("NVRTC"), "{}", e.message());
        assert_eq!(nvrtc_version().unwrap_err().code(), Code::Unavailable);
    }
}
