//! Packaging: the static-link flags documented in README.md (Install) and in
//! `packaging/libserve.pc.in` are the ones rustc prints for the staticlib; `scripts/install.sh`
//! installs a prefix that a C program builds against with nothing but
//! `pkg-config --cflags --libs libserve` — shared (loaded through its SONAME `libserve.so.0`) and,
//! from a `--no-shared` install, static with `pkg-config --static`.
//!
//! Cargo runs started here use their own target directory, `target/packaging`, so they never
//! wait for the build lock held by the `cargo test` that runs this test. The first run builds the
//! release dependencies there once (about a minute on two cores); later runs are incremental.
//!
//! Environment:
//! * `PKG_CONFIG` — pkg-config (default `pkg-config`). Missing fails the tests that need it
//!   unless `SERVE_SKIP_PKGCONFIG=1`, which makes them print why and pass.
//! * `CC` — the C compiler (default `cc`); `READELF` — readelf (default `readelf`). Missing fails
//!   unless `SERVE_SKIP_C=1`.
//! * `SERVE_PACKAGING_KEEP=1` — keep the scratch prefixes under `target/tmp`.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::native::{self, C_COMPILER, NATIVE_STATIC_LIBS, Tool, assert_success, env_flag, manifest_dir};

const PKG_CONFIG: Tool =
    Tool { env: "PKG_CONFIG", default: "pkg-config", skip_env: "SERVE_SKIP_PKGCONFIG", what: "pkg-config" };
const READELF: Tool =
    Tool { env: "READELF", default: "readelf", skip_env: "SERVE_SKIP_C", what: "binutils (readelf)" };

/// The lines around the static-link flags in README.md's Install section.
const README_BEGIN: &str = "<!-- native-static-libs: begin (checked by tests/packaging.rs) -->";
const README_END: &str = "<!-- native-static-libs: end -->";

const VERSION: &str = env!("CARGO_PKG_VERSION");
const MAJOR: &str = env!("CARGO_PKG_VERSION_MAJOR");

/// A C program that includes `<libserve.h>`, prints the library's and the header's versions,
/// and starts and frees a CPU runtime (which needs the native libraries at link time).
const PROBE_C: &str = r#"#include <stdio.h>
#include <libserve.h>

int main(void) {
  printf("serve_version %s header %d.%d.%d\n", serve_version(), SERVE_VERSION_MAJOR,
         SERVE_VERSION_MINOR, SERVE_VERSION_PATCH);
  serve_runtime_options *options = NULL;
  serve_runtime *rt = NULL;
  serve_error *err = serve_runtime_options_new(&options);
  if (err == NULL) err = serve_runtime_options_set_backend(options, "cpu");
  if (err == NULL) err = serve_runtime_new(options, &rt);
  serve_runtime_options_free(options);
  if (err != NULL) {
    fprintf(stderr, "%s\n", serve_error_message(err));
    serve_error_free(err);
    return 1;
  }
  printf("backend %s\n", serve_runtime_backend(rt));
  serve_runtime_free(rt);
  return 0;
}
"#;

fn packaging_target_dir() -> PathBuf {
    native::target_root().0.join("packaging")
}

fn keep() -> bool {
    env_flag("SERVE_PACKAGING_KEEP")
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

/// What rustc prints for `--print native-static-libs` when building the staticlib.
fn rustc_native_static_libs() -> Vec<String> {
    let mut cmd = Command::new(native::cargo());
    cmd.args(["rustc", "--locked", "--release", "--lib", "--crate-type", "staticlib", "--manifest-path"])
        .arg(manifest_dir().join("Cargo.toml"))
        .arg("--target-dir")
        .arg(packaging_target_dir())
        .args(["--", "--print", "native-static-libs"])
        .env("CARGO_TERM_COLOR", "never");
    eprintln!("running {cmd:?}");
    let output = cmd.output().expect("run cargo");
    assert_success(&output, "cargo rustc --print native-static-libs");
    // Cargo replays rustc's notes when the staticlib is already fresh, so this line is always there.
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .find_map(|l| l.split_once("native-static-libs:").map(|(_, libs)| libs.to_owned()))
        .unwrap_or_else(|| panic!("no `native-static-libs:` note in cargo's output:\n{stderr}"));
    words(&line)
}

/// The flags between README_BEGIN and README_END (code-fence lines ignored).
fn readme_static_libs() -> Vec<String> {
    let readme = std::fs::read_to_string(manifest_dir().join("README.md")).unwrap();
    let start = readme
        .find(README_BEGIN)
        .unwrap_or_else(|| panic!("README.md lacks the line `{README_BEGIN}` (Install section)"));
    let block = &readme[start + README_BEGIN.len()..];
    let end = block.find(README_END).unwrap_or_else(|| panic!("README.md lacks the line `{README_END}`"));
    block[..end].lines().filter(|l| !l.trim_start().starts_with("```")).flat_map(words).collect()
}

/// The `Libs.private:` flags of packaging/libserve.pc.in.
fn pc_template_libs_private() -> Vec<String> {
    let template = std::fs::read_to_string(manifest_dir().join("packaging/libserve.pc.in")).unwrap();
    let line = template
        .lines()
        .find_map(|l| l.strip_prefix("Libs.private:"))
        .expect("packaging/libserve.pc.in has no Libs.private line");
    words(line)
}

#[test]
fn documented_static_link_flags_match_rustc() {
    let rustc = rustc_native_static_libs();
    assert!(!rustc.is_empty(), "rustc printed no native static libraries");
    assert_eq!(
        readme_static_libs(),
        rustc,
        "README.md's native-static-libs block differs from what rustc prints: copy rustc's list there"
    );
    assert_eq!(
        pc_template_libs_private(),
        rustc,
        "Libs.private in packaging/libserve.pc.in differs from what rustc prints"
    );
    assert_eq!(
        NATIVE_STATIC_LIBS, rustc,
        "NATIVE_STATIC_LIBS in tests/common/native.rs (used to link the C and C++ examples) differs from rustc's list"
    );
}

/// Run scripts/install.sh with `args` (options, then the prefix) into the packaging target dir.
fn install(args: &[&std::ffi::OsStr], destdir: Option<&Path>) -> Output {
    let mut cmd = Command::new(manifest_dir().join("scripts/install.sh"));
    cmd.args(args)
        .env("CARGO", native::cargo())
        .env("CARGO_TARGET_DIR", packaging_target_dir())
        .env("CARGO_TERM_COLOR", "never");
    match destdir {
        Some(d) => cmd.env("DESTDIR", d),
        None => cmd.env_remove("DESTDIR"),
    };
    eprintln!("running {cmd:?}");
    cmd.output().expect("run scripts/install.sh")
}

fn install_ok(prefix: &Path, options: &[&str], destdir: Option<&Path>) {
    let mut args: Vec<&std::ffi::OsStr> = options.iter().map(std::ffi::OsStr::new).collect();
    args.push(prefix.as_os_str());
    assert_success(&install(&args, destdir), "scripts/install.sh");
}

/// `pkg-config ARGS libserve` with only `prefix`'s pkgconfig dir added to the search path.
fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let mut cmd = Command::new(PKG_CONFIG.program());
    cmd.args(args)
        .arg("libserve")
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .env_remove("PKG_CONFIG_SYSROOT_DIR");
    let output = cmd.output().expect("run pkg-config");
    assert_success(&output, &format!("pkg-config {}", args.join(" ")));
    words(&String::from_utf8_lossy(&output.stdout))
}

/// Entries of an ELF file's dynamic section with `tag` (e.g. "SONAME", "NEEDED"): the names in
/// brackets of `readelf -d`.
fn dynamic_entries(file: &Path, tag: &str) -> Vec<String> {
    let output = Command::new(READELF.program()).arg("-d").arg(file).output().expect("run readelf");
    assert_success(&output, &format!("readelf -d {}", file.display()));
    let needle = format!("({tag})");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| Some(l[l.find('[')? + 1..l.rfind(']')?].to_owned()))
        .collect()
}

/// Compile and link PROBE_C with exactly `flags` (from pkg-config); returns the executable.
fn build_probe(dir: &Path, flags: &[String]) -> PathBuf {
    let src = dir.join("probe.c");
    std::fs::write(&src, PROBE_C).unwrap();
    let exe = dir.join("probe");
    let mut cmd = Command::new(C_COMPILER.program());
    cmd.arg(&src).arg("-o").arg(&exe).args(flags);
    native::run_compiler(&mut cmd, "compiling probe.c with pkg-config's flags");
    exe
}

/// Run the probe; it must report this crate's version for both library and header.
fn run_probe(exe: &Path, ld_library_path: Option<&Path>) {
    let mut cmd = Command::new(exe);
    match ld_library_path {
        Some(p) => cmd.env("LD_LIBRARY_PATH", p),
        None => cmd.env_remove("LD_LIBRARY_PATH"),
    };
    let output = cmd.output().expect("run the probe");
    assert_success(&output, "the probe");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        format!("serve_version {VERSION} header {VERSION}\nbackend cpu\n"),
        "the probe linked against the installed libserve reports other versions"
    );
}

fn libserve_entries(lib: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(lib)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libserve"))
        .collect();
    names.sort();
    names
}

/// Whether pkg-config, a C compiler and readelf are all there (each fails or skips as its
/// `Tool` says).
fn link_tools_available() -> bool {
    PKG_CONFIG.available() && C_COMPILER.available() && READELF.available()
}

/// Install with `options` into `<scratch>/prefix`; returns (scratch, prefix, prefix/lib).
fn install_into_scratch(label: &str, options: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    let dir = native::scratch(label);
    let prefix = dir.join("prefix");
    install_ok(&prefix, options, None);
    let lib = prefix.join("lib");
    (dir, prefix, lib)
}

#[test]
fn installed_prefix_links_with_pkg_config_shared() {
    if !link_tools_available() {
        return;
    }
    let (dir, prefix, lib) = install_into_scratch("packaging-shared", &[]);

    // Layout: header, archive, real .so, SONAME link, development link, pkg-config file.
    assert_eq!(
        std::fs::read(prefix.join("include/libserve.h")).unwrap(),
        std::fs::read(manifest_dir().join("include/libserve.h")).unwrap(),
        "installed header differs from include/libserve.h"
    );
    let real = format!("libserve.so.{VERSION}");
    let soname = format!("libserve.so.{MAJOR}");
    assert_eq!(
        libserve_entries(&lib),
        ["libserve.a", "libserve.so", soname.as_str(), real.as_str()],
        "installed libraries"
    );
    assert!(std::fs::symlink_metadata(lib.join(&real)).unwrap().is_file(), "{real} is not a regular file");
    assert_eq!(std::fs::read_link(lib.join(&soname)).unwrap(), Path::new(&real));
    assert_eq!(std::fs::read_link(lib.join("libserve.so")).unwrap(), Path::new(&soname));

    // The SONAME of the installed library is the ABI major.
    assert_eq!(dynamic_entries(&lib.join(&real), "SONAME"), [soname.as_str()], "SONAME of {real}");

    assert_eq!(pkg_config(&prefix, &["--modversion"]), [VERSION]);
    let flags = pkg_config(&prefix, &["--cflags", "--libs"]);
    assert_eq!(
        flags,
        [format!("-I{}", prefix.join("include").display()), format!("-L{}", lib.display()), "-lserve".into()],
        "pkg-config --cflags --libs libserve"
    );
    let exe = build_probe(&dir, &flags);
    assert!(
        dynamic_entries(&exe, "NEEDED").contains(&soname),
        "the probe does not load libserve through its SONAME {soname}"
    );
    run_probe(&exe, Some(&lib));
    native::cleanup(&dir, keep());
}

#[test]
fn static_only_prefix_links_with_pkg_config_static() {
    if !link_tools_available() {
        return;
    }
    let (dir, prefix, lib) = install_into_scratch("packaging-static", &["--no-shared"]);
    assert_eq!(libserve_entries(&lib), ["libserve.a"], "a --no-shared install holds only the archive");

    let flags = pkg_config(&prefix, &["--static", "--cflags", "--libs"]);
    let mut want = vec![
        format!("-I{}", prefix.join("include").display()),
        format!("-L{}", lib.display()),
        "-lserve".into(),
    ];
    want.extend(NATIVE_STATIC_LIBS.iter().map(|s| s.to_string()));
    assert_eq!(flags, want, "pkg-config --static --cflags --libs libserve");
    let exe = build_probe(&dir, &flags);
    let needed = dynamic_entries(&exe, "NEEDED");
    assert!(!needed.iter().any(|n| n.starts_with("libserve")), "statically linked probe needs {needed:?}");
    run_probe(&exe, None);
    native::cleanup(&dir, keep());
}

#[test]
fn install_stages_under_destdir() {
    let dir = native::scratch("packaging-destdir");
    let stage = dir.join("stage");
    let prefix = Path::new("/opt/libserve-staged-test");
    install_ok(prefix, &[], Some(&stage));
    let staged = stage.join("opt/libserve-staged-test");
    for f in ["include/libserve.h", "lib/libserve.a", "lib/pkgconfig/libserve.pc"] {
        assert!(staged.join(f).is_file(), "{f} not staged under DESTDIR");
    }
    assert!(staged.join(format!("lib/libserve.so.{VERSION}")).is_file());
    assert!(!prefix.exists(), "installed outside DESTDIR");
    let pc = std::fs::read_to_string(staged.join("lib/pkgconfig/libserve.pc")).unwrap();
    assert!(pc.lines().any(|l| l == format!("prefix={}", prefix.display())), "libserve.pc:\n{pc}");
    assert!(pc.lines().any(|l| l == format!("Version: {VERSION}")), "libserve.pc:\n{pc}");
    assert!(!pc.contains(stage.to_str().unwrap()), "DESTDIR leaked into libserve.pc:\n{pc}");
    assert!(!pc.contains('@'), "unsubstituted placeholder in libserve.pc:\n{pc}");
    native::cleanup(&dir, keep());
}

#[test]
fn install_refuses_a_relative_prefix_before_building() {
    let output = install(&[OsString::from("relative/prefix").as_os_str()], None);
    assert_eq!(output.status.code(), Some(2), "scripts/install.sh relative/prefix: {output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("PREFIX must be an absolute path"));
    assert!(!manifest_dir().join("relative").exists());
}
