//! `serve infer MODEL_DIR --input FILE.jsonl` (ARCHITECTURE.md §6): one request per line, one result line
//! per request, in input order.
//!
//! Memory is bounded whatever the input: a line is stored only up to `--max-line-bytes` (longer
//! ones are skipped to their newline and answered with an error line), at most
//! [`READ_AHEAD_BYTES`] of lines wait between the reader thread and the submitting loop, and a
//! line is parsed straight into its typed request (`request.rs`).

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::Path;
use std::sync::mpsc::{self, SyncSender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serve::{Code, Completion, CompletionQueue, Model, ModelOptions, Output, PolicyConfig, SubmitOptions};

use crate::request::{F32s, ResultLine, error_line, parse_request};
use crate::{CliResult, InferArgs, build_runtime, fatal, stdout_err, timeout_policy};

/// `--max-line-bytes` default: the longest request line read (not counting its `\n`). A flat
/// 16 MiB: about 700 000 f32s or tokens in JSON, far more than any model's input (an mlp's input
/// width; 1024 tokens or tree nodes by default), and small enough that a bad line costs little.
pub(crate) const DEFAULT_MAX_LINE_BYTES: usize = 16 << 20;
/// The most `--max-line-bytes` may be set to (1 GiB).
pub(crate) const MAX_LINE_BYTES_LIMIT: usize = 1 << 30;
/// A line over the limit is skipped to its newline; one still without a newline after this many
/// more bytes (a source with no newlines, such as `/dev/zero`) ends the input there.
const MAX_SKIP_BYTES: u64 = 1 << 30;
/// Bytes of lines read ahead of the submitting loop (beyond the line being handed over).
const READ_AHEAD_BYTES: usize = 64 << 20;

pub(crate) fn cmd_infer(a: InferArgs) -> CliResult<()> {
    let reader = open_input(&a.input)?;
    let rt = build_runtime(a.rt)?;
    let opts = ModelOptions { admission_bound: a.max_inflight, ..ModelOptions::default() };
    let model = rt
        .load_model_with(&a.model_dir, opts, |net, opts| {
            // Recurrent models take cellular batching (the default); fixed-shape ones the
            // timeout batching the flags describe.
            if !net.is_recurrent() {
                opts.policy = PolicyConfig::Timeout(timeout_policy(a.max_batch, a.max_wait_us, 1));
            }
            Ok(())
        })
        .map_err(|e| fatal(format!("cannot load model {}: {e}", a.model_dir.display())))?;
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let summary = infer_stream(&model, reader, a.max_line_bytes, &mut out);
    out.flush().map_err(stdout_err)?;
    let summary = summary?;
    if io::stderr().is_terminal() {
        eprintln!("serve infer: {} request(s), {} error(s)", summary.lines, summary.errors);
    }
    Ok(())
}

/// Open `--input`: a file, or standard input for `-`.
pub(crate) fn open_input(path: &Path) -> CliResult<Box<dyn BufRead + Send>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(io::stdin())));
    }
    let cant = |e: &dyn fmt::Display| fatal(format!("cannot read input {}: {e}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| cant(&e))?;
    if meta.is_dir() {
        return Err(cant(&"is a directory"));
    }
    let f = File::open(path).map_err(|e| cant(&e))?;
    Ok(Box::new(BufReader::with_capacity(1 << 16, f)))
}

/// What [`infer_stream`] did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct InferSummary {
    pub(crate) lines: usize,
    pub(crate) errors: usize,
}

enum LineMsg {
    Line(Vec<u8>),
    /// A line longer than the limit, skipped: its length before the `\n`; `ended` is false when
    /// no newline came within [`MAX_SKIP_BYTES`] and reading stopped.
    TooLong {
        bytes: u64,
        ended: bool,
    },
    Failed(io::Error),
}

/// Memory of lines sent to the submitting loop and not yet taken by it (their buffers'
/// capacity, not only their length), bounded by [`READ_AHEAD_BYTES`].
#[derive(Default)]
struct ReadAhead {
    state: Mutex<Held>,
    changed: Condvar,
}

#[derive(Default)]
struct Held {
    bytes: usize,
    /// The submitting loop has ended (the reader then stops).
    closed: bool,
}

impl ReadAhead {
    /// Wait until `n` more bytes fit (a line always fits when nothing else is held); false when
    /// the loop has ended.
    fn reserve(&self, n: usize) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while !s.closed && s.bytes > 0 && s.bytes + n > READ_AHEAD_BYTES {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.bytes += n;
        !s.closed
    }

    fn release(&self, n: usize) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).bytes -= n;
        self.changed.notify_one();
    }

    fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.changed.notify_one();
    }
}

/// Closes the read-ahead however the submitting loop ends.
struct CloseOnDrop(Arc<ReadAhead>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Skip the rest of a line without storing it: the bytes skipped before its `\n`, and whether
/// it ended (at a newline, consumed, or at the end of input) within `cap` bytes.
fn skip_line(r: &mut dyn BufRead, cap: u64) -> io::Result<(u64, bool)> {
    let mut skipped = 0u64;
    loop {
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            return Ok((skipped, true));
        }
        if let Some(i) = memchr::memchr(b'\n', chunk) {
            r.consume(i + 1);
            return Ok((skipped + i as u64, true));
        }
        let n = chunk.len();
        r.consume(n);
        skipped += n as u64;
        if skipped >= cap {
            return Ok((skipped, false));
        }
    }
}

/// Read one line of at most `limit` bytes before its `\n` (the `\n`, and a `\r` before it,
/// removed); a longer one is skipped ([`skip_line`]). `None` at the end of input.
fn read_line(r: &mut dyn BufRead, limit: usize) -> io::Result<Option<LineMsg>> {
    let mut buf = Vec::new();
    // At most limit + 1 bytes: the line and its newline, or one byte too many.
    let n = r.take(limit as u64 + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
    } else if buf.len() > limit {
        let (more, ended) = skip_line(r, MAX_SKIP_BYTES)?;
        return Ok(Some(LineMsg::TooLong { bytes: buf.len() as u64 + more, ended }));
    }
    Ok(Some(LineMsg::Line(buf)))
}

/// Reads lines and hands them over until end of input, a read error, an unending line, or the
/// receiver hanging up.
fn read_lines(mut r: Box<dyn BufRead + Send>, limit: usize, tx: SyncSender<LineMsg>, ahead: Arc<ReadAhead>) {
    loop {
        let msg = match read_line(&mut r, limit) {
            Ok(None) => return,
            Ok(Some(m)) => m,
            Err(e) => LineMsg::Failed(e),
        };
        let stop = matches!(msg, LineMsg::Failed(_) | LineMsg::TooLong { ended: false, .. });
        if let LineMsg::Line(l) = &msg
            && !ahead.reserve(l.capacity())
        {
            return;
        }
        if tx.send(msg).is_err() || stop {
            return;
        }
    }
}

/// Output lines by input index, written out as soon as every earlier line is known.
struct Ordered<'a> {
    out: &'a mut dyn Write,
    /// Index of `pending[0]`.
    next: usize,
    pending: VecDeque<Option<String>>,
    errors: usize,
}

impl Ordered<'_> {
    fn set(&mut self, index: usize, line: String, is_error: bool) {
        let k = index - self.next;
        if self.pending.len() <= k {
            self.pending.resize(k + 1, None);
        }
        self.pending[k] = Some(line);
        self.errors += usize::from(is_error);
    }

    fn write_ready(&mut self) -> CliResult<()> {
        while let Some(Some(_)) = self.pending.front() {
            if let Some(Some(line)) = self.pending.pop_front() {
                writeln!(self.out, "{line}").map_err(stdout_err)?;
            }
            self.next += 1;
        }
        Ok(())
    }
}

fn render(index: usize, result: serve::Result<Output>) -> (String, bool) {
    let encoded = match &result {
        Ok(Output::F32(v)) => serde_json::to_string(&ResultLine::F32(F32s(v))),
        Ok(Output::Tokens(t)) => serde_json::to_string(&ResultLine::Tokens(t)),
        Err(e) => return (error_line(e.code(), &format!("line {}: {}", index + 1, e.message())), true),
    };
    match encoded {
        Ok(line) => (line, false),
        Err(e) => {
            (error_line(Code::Internal, &format!("line {}: cannot encode the output: {e}", index + 1)), true)
        }
    }
}

/// Run every line of `reader` as a request of `model` and write one line per request to `out`,
/// in input order. Requests are submitted as they are read (so they batch); completions arrive
/// on one completion queue tagged with the line index. At the end of input the model is flushed
/// (its last partial batch does not wait out the max wait). A line over `max_line_bytes` is an
/// error line. Only an unreadable input is fatal.
pub(crate) fn infer_stream(
    model: &Model,
    reader: Box<dyn BufRead + Send>,
    max_line_bytes: usize,
    out: &mut dyn Write,
) -> CliResult<InferSummary> {
    let (tx, rx) = mpsc::sync_channel::<LineMsg>(1024);
    let ahead = Arc::new(ReadAhead::default());
    let _close = CloseOnDrop(ahead.clone());
    let reader_ahead = ahead.clone();
    std::thread::Builder::new()
        .name("serve-infer-reader".into())
        .spawn(move || read_lines(reader, max_line_bytes, tx, reader_ahead))
        .map_err(|e| fatal(format!("cannot start the input reader thread: {e}")))?;
    let queue = CompletionQueue::new()?;
    let mut ordered = Ordered { out, next: 0, pending: VecDeque::new(), errors: 0 };
    let mut in_flight = 0usize;
    let mut lines = 0usize;
    let mut read_error: Option<io::Error> = None;
    let mut eof = false;
    let mut batch: Vec<Completion> = Vec::with_capacity(256);

    // Move finished requests into `ordered`, waiting up to `wait` for the first one.
    let mut drain = |ordered: &mut Ordered<'_>, in_flight: &mut usize, wait: Duration| -> CliResult<()> {
        if *in_flight == 0 {
            return ordered.write_ready();
        }
        batch.clear();
        queue.next_into(&mut batch, 1024, wait)?;
        for c in batch.drain(..) {
            *in_flight -= 1;
            let (line, is_err) = render(c.tag as usize, c.result);
            ordered.set(c.tag as usize, line, is_err);
        }
        ordered.write_ready()
    };

    loop {
        drain(&mut ordered, &mut in_flight, Duration::ZERO)?;
        if eof {
            if in_flight == 0 {
                break;
            }
            drain(&mut ordered, &mut in_flight, Duration::from_millis(100))?;
            continue;
        }
        let msg = if in_flight == 0 {
            ordered.out.flush().map_err(stdout_err)?;
            rx.recv().ok()
        } else {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Disconnected) => None,
                Err(TryRecvError::Empty) => {
                    // Input is slow (a terminal, a pipe): show what is done, then wait briefly
                    // for completions before looking for more input.
                    ordered.out.flush().map_err(stdout_err)?;
                    drain(&mut ordered, &mut in_flight, Duration::from_millis(2))?;
                    continue;
                }
            }
        };
        let bytes = match msg {
            None => {
                eof = true;
                // No more requests: the last partial batch need not wait for a fuller one.
                model.flush();
                continue;
            }
            Some(LineMsg::Failed(e)) => {
                read_error = Some(e);
                eof = true;
                model.flush();
                continue;
            }
            Some(LineMsg::TooLong { bytes, ended }) => {
                let index = lines;
                lines += 1;
                let limit = format!("the limit is {max_line_bytes} (--max-line-bytes)");
                let msg = if ended {
                    format!("line {} is {bytes} bytes; {limit}", index + 1)
                } else {
                    format!(
                        "line {} has no newline in its first {bytes} bytes ({limit}); the input is read no further",
                        index + 1
                    )
                };
                ordered.set(index, error_line(Code::InvalidArgument, &msg), true);
                continue;
            }
            Some(LineMsg::Line(bytes)) => bytes,
        };
        let index = lines;
        lines += 1;
        let parsed = parse_request(&bytes);
        ahead.release(bytes.capacity());
        drop(bytes);
        let input = match parsed {
            Ok(input) => input,
            Err(msg) => {
                ordered.set(
                    index,
                    error_line(Code::InvalidArgument, &format!("line {}: {msg}", index + 1)),
                    true,
                );
                continue;
            }
        };
        loop {
            match model.submit_to(input.clone(), SubmitOptions::default(), &queue, index as u64) {
                Ok(_) => {
                    in_flight += 1;
                    break;
                }
                Err(e) if e.code() == Code::Busy => {
                    // The admission bound is full: let some requests finish, then retry. (With
                    // none of ours in flight, the bound is catching up with completions we
                    // already drained: pause briefly rather than spin.)
                    if in_flight == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    drain(&mut ordered, &mut in_flight, Duration::from_millis(10))?;
                }
                Err(e) => {
                    ordered.set(
                        index,
                        error_line(e.code(), &format!("line {}: {}", index + 1, e.message())),
                        true,
                    );
                    break;
                }
            }
        }
    }
    ordered.write_ready()?;
    ordered.out.flush().map_err(stdout_err)?;
    if let Some(e) = read_error {
        return Err(fatal(format!("cannot read input after line {lines}: {e}")));
    }
    Ok(InferSummary { lines, errors: ordered.errors })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &[u8], limit: usize) -> Vec<Result<String, (u64, bool)>> {
        let mut r = BufReader::with_capacity(8, text);
        let mut out = Vec::new();
        while let Some(m) = read_line(&mut r, limit).unwrap() {
            out.push(match m {
                LineMsg::Line(l) => Ok(String::from_utf8(l).unwrap()),
                LineMsg::TooLong { bytes, ended } => Err((bytes, ended)),
                LineMsg::Failed(e) => panic!("{e}"),
            });
        }
        out
    }

    #[test]
    fn lines_are_read_up_to_the_limit_and_longer_ones_skipped_to_their_end() {
        let text = b"1234\n12345\r\n123456789012345678901234\nab\r\n\n12345";
        assert_eq!(
            read_all(text, 5),
            vec![
                Ok("1234".into()),
                Err((6, true)), // the \r counts: 6 bytes before the \n
                Err((24, true)),
                Ok("ab".into()),
                Ok(String::new()),
                Ok("12345".into()), // the last line needs no newline
            ]
        );
        assert_eq!(read_all(b"123456", 5), vec![Err((6, true))]);
    }

    #[test]
    fn a_line_with_no_end_in_sight_is_skipped_at_most_cap_bytes() {
        let zeros = [0u8; 100];
        let mut r = BufReader::with_capacity(8, &zeros[..]);
        let (n, ended) = skip_line(&mut r, 40).unwrap();
        assert!(!ended);
        assert!((40..48).contains(&n), "{n}");
        let mut r = BufReader::with_capacity(8, &b"abc\nrest"[..]);
        assert_eq!(skip_line(&mut r, 40).unwrap(), (3, true));
        let mut rest = String::new();
        r.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "rest");
    }
}
