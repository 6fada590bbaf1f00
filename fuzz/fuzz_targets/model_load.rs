//! The model loader on arbitrary files: the input is `model.toml`'s length (2 bytes, little
//! endian), `model.toml`, then `weights.safetensors`, written into a scratch model directory and
//! loaded with `serve::model::load`. Seeds (`scripts/fuzz.sh`) are the committed fixtures.
//!
//! Checked: loading never panics, never allocates beyond what the files justify (libFuzzer's
//! `-rss_limit_mb` / `-malloc_limit_mb` turn that into a crash), and fails only with `FORMAT`,
//! `INVALID_ARGUMENT` or `NOT_FOUND` (never `INTERNAL`); a model that loads passes its own check.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use serve::Code;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
        let d = base.join(format!("serve-fuzz-model-{}", std::process::id()));
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
