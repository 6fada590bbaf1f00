//! Error codes and the error type shared by the Rust API and the C ABI.
//!
//! [`Code`] values are part of the stable C ABI (`serve_code`): every variant has an explicit
//! number that is never changed or reused; new codes are only appended.

use std::ffi::CStr;
use std::fmt;

/// Stable status codes. `SERVE_CODE_<NAME>` in C; `NAME` in `serve infer` output.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Code {
    /// Success.
    Ok = 0,
    /// An argument is invalid: NULL pointer, wrong input length, bad token id, malformed tree, …
    InvalidArgument = 1,
    /// A file or directory does not exist.
    NotFound = 2,
    /// A model directory is malformed: bad model.toml, missing / extra / misshaped tensor, wrong dtype,
    /// truncated safetensors file, unknown model kind.
    Format = 3,
    /// An admission bound is full; the request was not accepted. Retry later.
    Busy = 4,
    /// The request's deadline passed before it could complete.
    DeadlineExceeded = 5,
    /// The request was cancelled, explicitly or by shutdown.
    Cancelled = 6,
    /// The runtime is shutting down or shut down; no new requests are accepted.
    Shutdown = 7,
    /// A requested backend or device is not available on this machine.
    Unavailable = 8,
    /// The request is valid but this build does not support it.
    Unsupported = 9,
    /// The backend failed while executing (device error, …).
    Backend = 10,
    /// An I/O error other than a missing file.
    Io = 11,
    /// A bug in libserve (including a caught panic). Please report it.
    Internal = 12,
}

impl Code {
    /// Every code, in numeric order.
    ///
    /// cbindgen:ignore
    pub const ALL: [Code; 13] = [
        Code::Ok,
        Code::InvalidArgument,
        Code::NotFound,
        Code::Format,
        Code::Busy,
        Code::DeadlineExceeded,
        Code::Cancelled,
        Code::Shutdown,
        Code::Unavailable,
        Code::Unsupported,
        Code::Backend,
        Code::Io,
        Code::Internal,
    ];

    /// The name used by `serve infer` and the C enum (without the `SERVE_CODE_` prefix).
    pub fn name(self) -> &'static str {
        self.c_name().to_str().expect("code names are ASCII")
    }

    /// [`name`](Self::name) as a NUL-terminated string with static storage (for the C ABI).
    pub fn c_name(self) -> &'static CStr {
        match self {
            Code::Ok => c"OK",
            Code::InvalidArgument => c"INVALID_ARGUMENT",
            Code::NotFound => c"NOT_FOUND",
            Code::Format => c"FORMAT",
            Code::Busy => c"BUSY",
            Code::DeadlineExceeded => c"DEADLINE_EXCEEDED",
            Code::Cancelled => c"CANCELLED",
            Code::Shutdown => c"SHUTDOWN",
            Code::Unavailable => c"UNAVAILABLE",
            Code::Unsupported => c"UNSUPPORTED",
            Code::Backend => c"BACKEND",
            Code::Io => c"IO",
            Code::Internal => c"INTERNAL",
        }
    }

    /// The code with the given numeric value, if any.
    pub fn from_u32(v: u32) -> Option<Code> {
        Code::ALL.get(v as usize).copied()
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An error: a stable [`Code`] and a message saying what was wrong and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    code: Code,
    message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        debug_assert!(code != Code::Ok, "an Error never carries Code::Ok");
        Error { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, message)
    }
    pub fn format(message: impl Into<String>) -> Error {
        Error::new(Code::Format, message)
    }
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(Code::Internal, message)
    }
    pub fn code(&self) -> Code {
        self.code
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    /// Prefix the message with context (`"<context>: <message>"`), keeping the code.
    pub fn context(mut self, context: impl fmt::Display) -> Error {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_dense_and_round_trip() {
        for (i, c) in Code::ALL.iter().enumerate() {
            assert_eq!(*c as u32, i as u32);
            assert_eq!(Code::from_u32(i as u32), Some(*c));
        }
        assert_eq!(Code::from_u32(Code::ALL.len() as u32), None);
    }

    #[test]
    fn context_keeps_code() {
        let e = Error::format("tensor `x` missing").context("/m/weights.safetensors");
        assert_eq!(e.code(), Code::Format);
        assert_eq!(e.message(), "/m/weights.safetensors: tensor `x` missing");
    }
}
