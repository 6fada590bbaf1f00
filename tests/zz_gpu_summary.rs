//! The one line that ends `cargo test`: how many GPU tests this run skipped, and why
//! (ARCHITECTURE.md §9). Cargo runs integration-test binaries in name order, so this one (`zz_`)
//! runs last, after every GPU test binary of the same run has recorded its skips
//! (`common::gpu::skip`, keyed by the cargo process that runs them all).
//!
//! Without a GPU every GPU test passes as a skip; this line makes that visible instead of 49
//! silent passes. Under `SERVE_REQUIRE_GPU=1` a skip is a failure, so none may be recorded.

mod common;

use std::collections::BTreeMap;
use std::io::Write;

#[test]
fn gpu_tests_skipped_in_this_run() {
    let file = common::gpu::skips_file();
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    // Records of earlier runs (other cargo processes) are stale: remove them.
    if let Some(dir) = file.parent().and_then(|d| std::fs::read_dir(d).ok()) {
        for e in dir.flatten() {
            if e.path() != file {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_file(&file);
    let mut why: BTreeMap<String, usize> = BTreeMap::new();
    let mut binaries: BTreeMap<String, usize> = BTreeMap::new();
    let mut skipped = 0;
    for line in text.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        assert_eq!(fields.len(), 3, "a malformed skip record in {}: {line:?}", file.display());
        assert!(!fields[2].is_empty(), "a skip without its reason: {line:?}");
        // One reason per cause: "no CUDA device (…)" and the like, details after the parenthesis cut.
        let cause = fields[2].split(" (").next().unwrap_or(fields[2]).to_string();
        *why.entry(cause).or_default() += 1;
        *binaries.entry(fields[0].to_string()).or_default() += 1;
        skipped += 1;
    }
    if common::native::env_flag("SERVE_REQUIRE_GPU") {
        assert_eq!(skipped, 0, "SERVE_REQUIRE_GPU=1, yet GPU tests were skipped: {text}");
    }
    let summary = if skipped == 0 {
        "GPU tests: none skipped in this run".to_string()
    } else {
        format!(
            "GPU tests: {skipped} SKIPPED ({}) because: {}; on a GPU machine run them with \
             SERVE_REQUIRE_GPU=1 (scripts/gpu-verify.sh)",
            binaries.iter().map(|(b, n)| format!("{b} {n}")).collect::<Vec<_>>().join(", "),
            why.iter().map(|(w, n)| format!("{w} ({n})")).collect::<Vec<_>>().join("; "),
        )
    };
    // The test harness captures `println!` / `eprintln!` of a passing test; a direct write to the
    // process's stderr is not captured, so the line is visible in a plain `cargo test`.
    let _ = std::io::stderr().write_all(format!("\n{summary}\n\n").as_bytes());
}
