//! The model loader on arbitrary files: the input is `model.toml`'s length (2 bytes, little
//! endian), `model.toml`, then `weights.safetensors`, written into a scratch model directory and
//! loaded with `serve::model::load`. Seeds (`scripts/fuzz.sh`) are the committed fixtures.
//!
//! Checked: loading never panics, never allocates beyond what the files justify (libFuzzer's
//! `-rss_limit_mb` / `-malloc_limit_mb` turn that into a crash), and fails only with `FORMAT`,
//! `INVALID_ARGUMENT` or `NOT_FOUND` (never `INTERNAL`); a model that loads passes its own check.

#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use serve::Code;

/// The scratch model directory of this process, under the fuzz crate's target dir. libFuzzer
/// ends the process with `exit`, so nothing removes it then: earlier processes' directories are
/// removed here instead, once their process is gone.
fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/model_load-scratch");
        for old in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let pid = old.file_name().to_string_lossy().into_owned();
            if !Path::new("/proc").join(&pid).exists() {
                let _ = std::fs::remove_dir_all(old.path());
            }
        }
        let d = base.join(std::process::id().to_string());
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let toml_len = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (toml, weights) = data[2..].split_at(toml_len);
    let dir = scratch();
    std::fs::write(dir.join("model.toml"), toml).unwrap();
    std::fs::write(dir.join("weights.safetensors"), weights).unwrap();
    match serve::model::load(dir) {
        Ok(net) => net.check().expect("a loaded model passes its own check"),
        Err(e) => assert!(
            matches!(e.code(), Code::Format | Code::InvalidArgument | Code::NotFound),
            "load failed with {:?}: {e}",
            e.code()
        ),
    }
});
