//! The committed C header must be exactly what cbindgen (pinned) generates from src/ffi, and its
//! version macros must match Cargo.toml. `SERVE_UPDATE_HEADER=1 cargo test --test header`
//! rewrites it.

use std::path::Path;

fn generate() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(Path::new(root).join("cbindgen.toml")).expect("cbindgen.toml");
    // Only the C ABI module (cbindgen follows its `mod` items) and the error codes it exports.
    let builder = cbindgen::Builder::new()
        .with_config(config)
        .with_src(Path::new(root).join("src/ffi/mod.rs"))
        .with_src(Path::new(root).join("src/error.rs"));
    let mut out = Vec::new();
    builder.generate().expect("cbindgen generates the header").write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

#[test]
fn header_matches_generated() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/libserve.h");
    let fresh = generate();
    if std::env::var_os("SERVE_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/libserve.h is stale: run `SERVE_UPDATE_HEADER=1 cargo test --test header` and commit it"
    );
}

#[test]
fn version_macros_match_cargo_toml() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/libserve.h")).unwrap();
    for (name, want) in [
        ("SERVE_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("SERVE_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("SERVE_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        let line = header
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} missing from the header"));
        let value = line.split_whitespace().nth(2).unwrap();
        assert_eq!(value, want, "{name} in include/libserve.h");
    }
}

#[test]
fn every_export_is_documented() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/libserve.h")).unwrap();
    let lines: Vec<&str> = header.lines().collect();
    let mut undocumented = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let is_decl = (l.starts_with("serve_")
            || l.starts_with("const ")
            || l.starts_with("uint")
            || l.starts_with("void ")
            || l.starts_with("size_t ")
            || l.starts_with("int"))
            && l.contains("serve_")
            && l.contains('(');
        let is_define = l.starts_with("#define SERVE_");
        if (is_decl || is_define) && !(i > 0 && lines[i - 1].trim_start().starts_with("//")) {
            undocumented.push(*l);
        }
    }
    assert!(undocumented.is_empty(), "undocumented exports: {undocumented:#?}");
}
