//! Build script. Never fails for lack of CUDA: nothing here needs a GPU or a CUDA toolkit.
//!
//! * Gives the shared library the SONAME `libserve.so.<major>`: the C ABI major version is the
//!   crate's major version (`SERVE_VERSION_MAJOR`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    if target_os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libserve.so.{major}");
    }
}
