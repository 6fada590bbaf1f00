//! Bad model directories: every size a model file declares is bounded at load, every file is read
//! bounded and typed, and every error is a precise code and message (issue 18).

mod common;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use common::tempdir;
use serve::model::weights::{Tensor, write_safetensors};
use serve::model::{Lstm, Network, Seq2Seq, TreeLstm};
use serve::{Code, Error, ModelOptions, Runtime};

fn load(dir: &Path) -> Error {
    match serve::model::load(dir) {
        Ok(net) => panic!("{} loaded as a {} model; it should fail", dir.display(), net.kind()),
        Err(e) => e,
    }
}

/// `e` has `code` and its message contains every one of `parts`.
fn assert_error(e: &Error, code: Code, parts: &[&str]) {
    assert_eq!(e.code(), code, "{e}");
    for p in parts {
        assert!(e.message().contains(p), "`{}` should say `{p}`", e.message());
    }
}

/// A saved copy of `net` whose model.toml has `from` replaced by `to`.
fn edited(label: &str, net: Network, from: &str, to: &str) -> PathBuf {
    let dir = tempdir(label);
    net.save(&dir).unwrap();
    let toml = std::fs::read_to_string(dir.join("model.toml")).unwrap();
    assert!(toml.contains(from), "{toml}");
    std::fs::write(dir.join("model.toml"), toml.replace(from, to)).unwrap();
    dir
}

fn lstm() -> Network {
    Network::Lstm(Lstm::random(50, 8, 16, 2, 1))
}

/// A one-layer mlp directory with the given safetensors bytes.
fn mlp_dir(label: &str, weights: &[u8]) -> PathBuf {
    let dir = tempdir(label);
    std::fs::write(dir.join("model.toml"), "kind = \"mlp\"\n").unwrap();
    std::fs::write(dir.join("weights.safetensors"), weights).unwrap();
    dir
}

/// A safetensors file from a JSON header and a data section.
fn safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn sizes_over_their_limit_are_format_naming_the_key() {
    let seq2seq = || Network::Seq2Seq(Seq2Seq::random(40, 8, 16, 2, 1, 2, 12, 3));
    let tree = || Network::TreeLstm(TreeLstm::random(50, 8, 16, 4));
    let cases = [
        // 2^62: `4 * hidden` wraps to 0 in a release build.
        (edited("hidden62", lstm(), "hidden = 16", "hidden = 4611686018427387904"), "hidden", "65536"),
        (edited("hiddenmax", lstm(), "hidden = 16", "hidden = 9223372036854775807"), "hidden", "65536"),
        // vocab × embed would be 2^64: the vocab limit refuses it first.
        (
            edited("vocabembed", lstm(), "vocab = 50\nembed = 8", "vocab = 4294967296\nembed = 4294967296"),
            "vocab = 4294967296",
            "4194304",
        ),
        (edited("layers", lstm(), "layers = 2", "layers = 1000000"), "layers = 1000000", "1024"),
        (edited("maxlen", lstm(), "layers = 2\n", "layers = 2\nmax_len = 10000000\n"), "max_len", "1048576"),
        (
            edited("maxdecode", seq2seq(), "max_decode = 12", "max_decode = 1000000000000"),
            "max_decode",
            "65536",
        ),
        (edited("s2shidden", seq2seq(), "hidden = 16", "hidden = 4611686018427387904"), "hidden", "65536"),
        (
            edited("maxnodes", tree(), "hidden = 16\n", "hidden = 16\nmax_nodes = 10000000\n"),
            "max_nodes",
            "1048576",
        ),
        (edited("treevocab", tree(), "vocab = 50", "vocab = 1099511627776"), "vocab", "4194304"),
    ];
    for (dir, key, limit) in cases {
        assert_error(&load(&dir), Code::Format, &["model.toml", key, "is over the limit of", limit]);
    }
    // A size at its limit loads.
    let dir = edited("atlimit", seq2seq(), "max_decode = 12", "max_decode = 65536");
    assert!(serve::model::load(&dir).is_ok());
}

#[test]
fn a_huge_max_decode_is_refused_at_load_not_at_the_first_submit() {
    let rt = Runtime::builder().build().unwrap();
    let net = Network::Seq2Seq(Seq2Seq::random(40, 8, 16, 2, 1, 2, 12, 3));
    let dir = edited("rtdecode", net, "max_decode = 12", "max_decode = 1000000000000");
    let e = rt.load_model(&dir, ModelOptions::default()).err().expect("the load fails");
    assert_error(&e, Code::Format, &["max_decode = 1000000000000 is over the limit of 65536"]);
}

#[test]
fn mlp_widths_over_their_limit_are_format_naming_the_tensor() {
    let wide = serve::model::limits::MAX_MLP_WIDTH + 1;
    let dir = tempdir("wide");
    std::fs::write(dir.join("model.toml"), "kind = \"mlp\"\n").unwrap();
    let w = Tensor::new(vec![1, wide], vec![0.0; wide]);
    let b = Tensor::new(vec![1], vec![0.0]);
    write_safetensors(&dir.join("weights.safetensors"), &[("layers.0.weight", &w), ("layers.0.bias", &b)])
        .unwrap();
    assert_error(&load(&dir), Code::Format, &["`layers.0.weight`", "over the limit of 4194304"]);
}

#[test]
fn model_toml_over_its_limit_is_format() {
    let dir = tempdir("bigtoml");
    lstm().save(&dir).unwrap();
    let mut toml = std::fs::read_to_string(dir.join("model.toml")).unwrap();
    toml.push_str(&format!("name = \"{}\"\n", "x".repeat(2 << 20)));
    std::fs::write(dir.join("model.toml"), toml).unwrap();
    assert_error(&load(&dir), Code::Format, &["model.toml", "over the limit of 1048576 bytes"]);
}

/// Run `f` on another thread; fail (instead of hanging) if it takes over 20 s.
fn within_20s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(f()));
    rx.recv_timeout(Duration::from_secs(20)).expect("blocked: the load did not return within 20 s")
}

#[test]
fn non_regular_model_files_are_invalid_argument_and_never_block() {
    for file in ["model.toml", "weights.safetensors"] {
        let dir = tempdir("fifo");
        lstm().save(&dir).unwrap();
        let path = dir.join(file);
        std::fs::remove_file(&path).unwrap();
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
        let e = within_20s(move || load(&dir));
        assert_error(&e, Code::InvalidArgument, &[file, "is a FIFO", "regular file"]);
    }

    let dir = tempdir("devzero");
    lstm().save(&dir).unwrap();
    std::fs::remove_file(dir.join("weights.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("weights.safetensors")).unwrap();
    let e = within_20s(move || load(&dir));
    assert_error(&e, Code::InvalidArgument, &["weights.safetensors", "is a character device"]);

    let dir = tempdir("dirweights");
    lstm().save(&dir).unwrap();
    std::fs::remove_file(dir.join("weights.safetensors")).unwrap();
    std::fs::create_dir(dir.join("weights.safetensors")).unwrap();
    assert_error(&load(&dir), Code::InvalidArgument, &["weights.safetensors", "is a directory"]);

    let dir = tempdir("socket");
    lstm().save(&dir).unwrap();
    std::fs::remove_file(dir.join("weights.safetensors")).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(dir.join("weights.safetensors")).unwrap();
    assert_error(&load(&dir), Code::InvalidArgument, &["weights.safetensors", "not a regular file"]);

    let file = tempdir("filedir").join("model");
    std::fs::write(&file, "kind = \"mlp\"\n").unwrap();
    assert_error(
        &load(&file),
        Code::InvalidArgument,
        &["model directory", "is a regular file, not a directory"],
    );
}

#[test]
fn symlink_loops_are_reported_as_loops_not_as_missing() {
    let dir = tempdir("loopfile");
    lstm().save(&dir).unwrap();
    let w = dir.join("weights.safetensors");
    std::fs::remove_file(&w).unwrap();
    std::os::unix::fs::symlink(&w, &w).unwrap();
    assert_error(&load(&dir), Code::InvalidArgument, &["weights.safetensors", "symlink loop"]);

    let base = tempdir("loopdir");
    let (a, b) = (base.join("a"), base.join("b"));
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    assert_error(&load(&a), Code::InvalidArgument, &["model directory", "symlink loop"]);

    // A missing directory is still NOT_FOUND.
    assert_error(&load(&base.join("missing")), Code::NotFound, &["model directory", "does not exist"]);
}

const MLP_HEADER: &str = r#"{"layers.0.bias":{"dtype":"F32","shape":[2],"data_offsets":[32,40]},"layers.0.weight":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}}"#;

#[test]
fn the_header_must_describe_the_file_exactly() {
    let data = f32_bytes(&[0.5; 10]);
    // The header as written: loads.
    let ok = mlp_dir("exact", &safetensors(MLP_HEADER, &data));
    assert!(serve::model::load(&ok).is_ok());

    let mut longer = data.clone();
    longer.extend_from_slice(&[0; 7]);
    let e = load(&mlp_dir("trailing", &safetensors(MLP_HEADER, &longer)));
    assert_error(&e, Code::Format, &["not a valid safetensors file", "7 bytes after the last tensor"]);

    let e = load(&mlp_dir("short", &safetensors(MLP_HEADER, &data[..36])));
    assert_error(&e, Code::Format, &["truncated", "40 bytes of tensor data", "holds 36"]);

    let e = load(&mlp_dir("tiny", &[1, 2, 3]));
    assert_error(&e, Code::Format, &["3 bytes, too short"]);

    let mut huge_header = safetensors(MLP_HEADER, &data);
    huge_header[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = load(&mlp_dir("hugeheader", &huge_header));
    assert_error(&e, Code::Format, &["header of 18446744073709551615 bytes is over the limit"]);

    // A tensor whose offsets do not hold its shape (the crate's nameless "invalid shape, data
    // type, or offset for tensor") is named.
    let bad = MLP_HEADER.replace("\"shape\":[2,4]", "\"shape\":[2,5]");
    let e = load(&mlp_dir("badinfo", &safetensors(&bad, &data)));
    assert_error(
        &e,
        Code::Format,
        &["tensor `layers.0.weight`", "[2, 5]", "needs 40 bytes", "hold 32 bytes"],
    );
    let bad = MLP_HEADER.replace("[32,40]", "[36,44]");
    let e = load(&mlp_dir("gap", &safetensors(&bad, &f32_bytes(&[0.5; 11]))));
    assert_error(&e, Code::Format, &["tensor `layers.0.bias`", "[36, 44]", "must start at byte 32"]);
    let bad = MLP_HEADER.replace("[2,4]", "[4611686018427387904,4]");
    let e = load(&mlp_dir("overflow", &safetensors(&bad, &data)));
    assert_error(&e, Code::Format, &["tensor `layers.0.weight`", "more than the address space"]);
    let bad = MLP_HEADER.replace("\"F32\",\"shape\":[2]", "\"Q7\",\"shape\":[2]");
    let e = load(&mlp_dir("dtype", &safetensors(&bad, &data)));
    assert_error(&e, Code::Format, &["tensor `layers.0.bias`", "Q7"]);
}

#[test]
fn duplicate_tensor_names_are_format_naming_the_tensor() {
    let data = f32_bytes(&[0.5; 10]);
    // The same entry twice: JSON maps keep one, so the file would load as if it were once.
    let entry = r#""layers.0.bias":{"dtype":"F32","shape":[2],"data_offsets":[32,40]}"#;
    let header = MLP_HEADER.replacen('{', &format!("{{{entry},"), 1);
    let e = load(&mlp_dir("dup", &safetensors(&header, &data)));
    assert_error(&e, Code::Format, &["tensor `layers.0.bias` appears twice"]);
}

#[test]
fn non_finite_weights_are_format_naming_tensor_and_element() {
    for (v, what) in [(f32::NAN, "NaN"), (f32::INFINITY, "+inf"), (f32::NEG_INFINITY, "-inf")] {
        let mut vals = [0.5f32; 10];
        vals[8 + 1] = v; // layers.0.bias is stored after the weight: bias element 1
        let e = load(&mlp_dir("nonfinite", &safetensors(MLP_HEADER, &f32_bytes(&vals))));
        assert_error(&e, Code::Format, &[&format!("tensor `layers.0.bias` element 1 is {what}")]);
    }
    let Network::Lstm(mut m) = lstm() else { unreachable!() };
    m.stack.layers[1].w_hh[17] = f32::NAN;
    let dir = tempdir("nanlstm");
    Network::Lstm(m).save(&dir).unwrap();
    assert_error(&load(&dir), Code::Format, &["tensor `lstm.weight_hh_l1` element 17 is NaN"]);
}
