//! `serve infer MODEL_DIR --input FILE.jsonl` (DESIGN §6): one request per line, one result line
//! per request, in input order.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, IsTerminal, Write};
use std::path::Path;
use std::sync::mpsc::{self, SyncSender, TryRecvError};
use std::time::Duration;

use serde_json::{Value, json};

use serve::{
    Code, Completion, CompletionQueue, Input, Model, ModelOptions, Output, PolicyConfig, SubmitOptions,
};

use crate::{CliResult, InferArgs, build_runtime, fatal, stdout_err, timeout_policy};

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
    let summary = infer_stream(&model, reader, &mut out);
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
    Failed(io::Error),
}

/// Reads lines (without their `\n` / `\r\n`) and hands them over until end of input, a read
/// error, or the receiver hanging up.
fn read_lines(mut r: Box<dyn BufRead + Send>, tx: SyncSender<LineMsg>) {
    loop {
        let mut buf = Vec::new();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) => {
                if buf.last() == Some(&b'\n') {
                    buf.pop();
                    if buf.last() == Some(&b'\r') {
                        buf.pop();
                    }
                }
                if tx.send(LineMsg::Line(buf)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(LineMsg::Failed(e));
                return;
            }
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

fn error_line(code: Code, message: &str) -> String {
    json!({"error": {"code": code.name(), "message": message}}).to_string()
}

/// A successful result line. Serialized straight from the `f32`s (not through `Value`, which
/// would widen them to `f64` and print digits the model never computed).
#[derive(serde::Serialize)]
enum ResultLine<'a> {
    #[serde(rename = "output")]
    F32(&'a [f32]),
    #[serde(rename = "tokens")]
    Tokens(&'a [u32]),
}

fn render(index: usize, result: serve::Result<Output>) -> (String, bool) {
    let encoded = match &result {
        Ok(Output::F32(v)) => serde_json::to_string(&ResultLine::F32(v)),
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
/// on one completion queue tagged with the line index. Only an unreadable input is fatal.
pub(crate) fn infer_stream(
    model: &Model,
    reader: Box<dyn BufRead + Send>,
    out: &mut dyn Write,
) -> CliResult<InferSummary> {
    let (tx, rx) = mpsc::sync_channel::<LineMsg>(1024);
    std::thread::Builder::new()
        .name("serve-infer-reader".into())
        .spawn(move || read_lines(reader, tx))
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
                continue;
            }
            Some(LineMsg::Failed(e)) => {
                read_error = Some(e);
                eof = true;
                continue;
            }
            Some(LineMsg::Line(bytes)) => bytes,
        };
        let index = lines;
        lines += 1;
        let input = match parse_request(&bytes) {
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

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn json_array<'v>(key: &str, v: &'v Value, what: &str) -> Result<&'v Vec<Value>, String> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(format!("`{key}` must be an array of {what}, found {}", json_kind(other))),
    }
}

fn parse_f32s(key: &str, v: &Value) -> Result<Vec<f32>, String> {
    json_array(key, v, "numbers")?
        .iter()
        .enumerate()
        .map(|(j, x)| match x.as_f64() {
            Some(f) if (f as f32).is_finite() => Ok(f as f32),
            Some(_) => Err(format!("`{key}[{j}]` = {x} is outside the f32 range")),
            None => Err(format!("`{key}[{j}]` is {}, expected a number", json_kind(x))),
        })
        .collect()
}

fn parse_tokens(v: &Value) -> Result<Vec<u32>, String> {
    json_array("tokens", v, "token ids")?
        .iter()
        .enumerate()
        .map(|(j, x)| match x {
            Value::Number(n) => n.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| {
                format!("`tokens[{j}]` = {n} is not a token id (an integer in 0..={})", u32::MAX)
            }),
            other => Err(format!("`tokens[{j}]` is {}, expected an integer token id", json_kind(other))),
        })
        .collect()
}

fn parse_parents(v: &Value) -> Result<Vec<i32>, String> {
    json_array("parents", v, "parent indices")?
        .iter()
        .enumerate()
        .map(|(j, x)| match x {
            Value::Number(n) => {
                n.as_i64().and_then(|p| i32::try_from(p).ok()).filter(|&p| p >= -1).ok_or_else(|| {
                    format!("`parents[{j}]` = {n} is not a parent index (-1 for the root, else a node index)")
                })
            }
            other => Err(format!("`parents[{j}]` is {}, expected an integer parent index", json_kind(other))),
        })
        .collect()
}

/// Parse one request line: `{"input":[…]}`, `{"tokens":[…]}` or `{"tokens":[…],"parents":[…]}`.
/// The error says what is wrong and where within the line (the caller adds the line number).
fn parse_request(bytes: &[u8]) -> Result<Input, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not valid UTF-8 ({e})"))?;
    if text.trim().is_empty() {
        return Err("empty line; expected a JSON object such as {\"input\":[…]} or {\"tokens\":[…]}".into());
    }
    let v: Value = serde_json::from_str(text).map_err(|e| {
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        format!("malformed JSON at column {}: {}", e.column(), full.strip_suffix(&suffix).unwrap_or(&full))
    })?;
    let Value::Object(map) = v else {
        return Err(format!("expected a JSON object, found {}", json_kind(&v)));
    };
    if let Some(k) = map.keys().find(|k| !matches!(k.as_str(), "input" | "tokens" | "parents")) {
        return Err(format!(
            "unknown key `{k}` (a request has `input`, or `tokens` and optionally `parents`)"
        ));
    }
    match (map.get("input"), map.get("tokens"), map.get("parents")) {
        (Some(_), Some(_), _) => Err("a request has `input` or `tokens`, not both".into()),
        (Some(_), None, Some(_)) => Err("`parents` goes with `tokens`, not with `input`".into()),
        (Some(x), None, None) => Ok(Input::F32(parse_f32s("input", x)?)),
        (None, Some(t), None) => Ok(Input::Tokens(parse_tokens(t)?)),
        (None, Some(t), Some(p)) => {
            let tokens = parse_tokens(t)?;
            let parents = parse_parents(p)?;
            if tokens.len() != parents.len() {
                return Err(format!(
                    "`tokens` has {} entries but `parents` has {}; a tree needs one parent per node",
                    tokens.len(),
                    parents.len()
                ));
            }
            Ok(Input::Tree { tokens, parents })
        }
        (None, None, Some(_)) => Err("missing key `tokens` (`parents` needs the tree's `tokens`)".into()),
        (None, None, None) => {
            Err("missing key: a request needs `input` (mlp) or `tokens` (lstm, seq2seq, treelstm)".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Input, String> {
        parse_request(s.as_bytes())
    }

    #[test]
    fn parses_the_three_request_shapes() {
        assert_eq!(parse(r#"{"input":[1, 2.5, -3e2]}"#), Ok(Input::F32(vec![1.0, 2.5, -300.0])));
        assert_eq!(parse(r#"{"tokens":[0, 4294967295]}"#), Ok(Input::Tokens(vec![0, u32::MAX])));
        assert_eq!(
            parse(r#" {"parents":[-1,0], "tokens":[5,6]} "#),
            Ok(Input::Tree { tokens: vec![5, 6], parents: vec![-1, 0] })
        );
    }

    #[test]
    fn rejects_bad_lines_saying_where() {
        let err = |s: &str| parse(s).unwrap_err();
        assert!(err(r#"{"tokens":[1, 1.5]}"#).contains("`tokens[1]` = 1.5"));
        assert!(err(r#"{"tokens":[-1]}"#).contains("`tokens[0]` = -1"));
        assert!(err(r#"{"tokens":[4294967296]}"#).contains("`tokens[0]` = 4294967296"));
        assert!(err(r#"{"tokens":["a"]}"#).contains("`tokens[0]` is a string"));
        assert!(err(r#"{"tokens":[1],"parents":["x"]}"#).contains("`parents[0]` is a string"));
        assert!(err(r#"{"tokens":[1],"parents":[-2]}"#).contains("`parents[0]` = -2"));
        assert!(err(r#"{"tokens":[1,2],"parents":[-1]}"#).contains("one parent per node"));
        assert!(err(r#"{"tokens":[1],"parents":{}}"#).contains("`parents` must be an array"));
        assert!(err(r#"{"input":[1e39]}"#).contains("outside the f32 range"));
        assert!(err(r#"{"input":[null]}"#).contains("`input[0]` is null"));
        assert!(err(r#"{"input":[1], "tokens":[1]}"#).contains("not both"));
        assert!(err(r#"{"inputs":[1]}"#).contains("unknown key `inputs`"));
        assert!(err("{}").contains("missing key"));
        assert!(err("[1,2]").contains("expected a JSON object"));
        assert!(err("").contains("empty line"));
        let m = err(r#"{"input": [1, 2"#);
        assert!(m.starts_with("malformed JSON at column"), "{m}");
        assert!(!m.contains("at line"), "{m}");
        assert!(parse_request(b"{\"input\":[1]}\xff").unwrap_err().contains("UTF-8"));
    }
}
