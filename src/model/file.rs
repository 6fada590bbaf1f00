//! Bounded, typed access to the files of a model directory.
//!
//! A model file is opened first and then checked through the opened handle (`fstat`), so what is
//! checked is what is read: a path that is not a regular file (a FIFO, a device such as
//! `/dev/zero`, a directory, a socket — also behind a symlink) is `INVALID_ARGUMENT` naming the
//! path and what it is, a file over its size limit is `FORMAT`, and no read goes past the size the
//! file had when it was opened (plus one byte, to notice growth). Opening never blocks: a FIFO is
//! opened with `O_NONBLOCK` and refused. A symlink loop is reported as one (`INVALID_ARGUMENT`),
//! not as a missing file.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Code, Error, Result};

/// An I/O error on `path` as an [`Error`]: "does not exist" is `NOT_FOUND`, a symlink loop and a
/// path that cannot be opened as a file (a socket) are `INVALID_ARGUMENT`, the rest `IO`.
/// `what` names the path in the message (e.g. "model directory ").
pub(crate) fn io_error(what: &str, path: &Path, e: &io::Error) -> Error {
    let p = path.display();
    match e.raw_os_error() {
        Some(libc::ELOOP) => {
            Error::invalid(format!("{what}{p}: too many levels of symbolic links (a symlink loop)"))
        }
        Some(libc::ENXIO) => {
            Error::invalid(format!("{what}{p}: not a regular file (a socket, or a device with no driver)"))
        }
        _ if e.kind() == io::ErrorKind::NotFound => {
            Error::new(Code::NotFound, format!("{what}{p} does not exist"))
        }
        _ => Error::new(Code::Io, format!("{what}{p}: {e}")),
    }
}

/// What a non-regular file is, for messages.
fn describe(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

/// Open `path` for reading and check, on the opened handle, that it is a regular file of at most
/// `max` bytes. Returns the file and its size at open.
pub(crate) fn open_regular(path: &Path, max: u64) -> Result<(File, u64)> {
    // O_NONBLOCK: opening a FIFO with no writer returns at once (and is refused below) instead of
    // waiting for one; it changes nothing for a regular file. O_NOCTTY: a terminal device path
    // never becomes the process's controlling terminal.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| io_error("", path, &e))?;
    let meta = file.metadata().map_err(|e| io_error("", path, &e))?;
    if !meta.file_type().is_file() {
        return Err(Error::invalid(format!(
            "{}: is {}; a model file must be a regular file",
            path.display(),
            describe(&meta)
        )));
    }
    let len = meta.len();
    if len > max {
        return Err(Error::format(format!(
            "{}: {len} bytes is over the limit of {max} bytes for this file",
            path.display()
        )));
    }
    Ok((file, len))
}

/// Read a whole regular file of at most `max` bytes (see [`open_regular`]).
pub(crate) fn read_file(path: &Path, max: u64) -> Result<Vec<u8>> {
    let (file, len) = open_regular(path, max)?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(len + 1).read_to_end(&mut bytes).map_err(|e| io_error("", path, &e))?;
    if bytes.len() as u64 > len {
        return Err(Error::new(Code::Io, format!("{}: the file grew while it was read", path.display())));
    }
    Ok(bytes)
}

/// Check that `dir` is a model directory, following symlinks: `NOT_FOUND` when it does not exist,
/// `INVALID_ARGUMENT` when it is something else or a symlink loop.
pub(crate) fn check_dir(dir: &Path) -> Result<()> {
    let what = "model directory ";
    let meta = std::fs::metadata(dir).map_err(|e| io_error(what, dir, &e))?;
    if meta.is_dir() {
        Ok(())
    } else {
        Err(Error::invalid(format!("{what}{} is {}, not a directory", dir.display(), describe(&meta))))
    }
}
