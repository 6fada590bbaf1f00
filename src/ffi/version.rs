//! Version macros and `serve_version()`.
//!
//! The `SERVE_VERSION_*` values must equal Cargo.toml's version (a test checks). The ABI follows
//! the major version: enums and functions are only ever appended within one major version, and
//! the shared library's SONAME is `libserve.so.<major>`.

use std::ffi::c_char;

use crate::ffi_boundary;

/// Major version: changes only with an incompatible ABI change.
pub const SERVE_VERSION_MAJOR: u32 = 0;
/// Minor version: new functions and enum values, compatible.
pub const SERVE_VERSION_MINOR: u32 = 1;
/// Patch version: fixes only.
pub const SERVE_VERSION_PATCH: u32 = 0;

/// The version of the linked library, "MAJOR.MINOR.PATCH" (static storage). Compare with the
/// `SERVE_VERSION_*` macros of the header compiled against to detect a mismatched library.
#[unsafe(no_mangle)]
pub extern "C" fn serve_version() -> *const c_char {
    ffi_boundary! {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_cargo_version() {
        assert_eq!(SERVE_VERSION_MAJOR.to_string(), env!("CARGO_PKG_VERSION_MAJOR"));
        assert_eq!(SERVE_VERSION_MINOR.to_string(), env!("CARGO_PKG_VERSION_MINOR"));
        assert_eq!(SERVE_VERSION_PATCH.to_string(), env!("CARGO_PKG_VERSION_PATCH"));
        let v = unsafe { std::ffi::CStr::from_ptr(serve_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
