//go:build !libserve_pkgconfig

package libserve

// Default linking: the static library cargo builds in this checkout. Run
// `cargo build --release` at the repository root first. The flags are what
// `cargo rustc --release --lib --crate-type staticlib -- --print native-static-libs`
// prints for the crate on Linux; linking statically means no LD_LIBRARY_PATH is needed.
//
// Build with `-tags libserve_pkgconfig` to use an installed libserve instead (link_pkgconfig.go).

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: ${SRCDIR}/../../target/release/libserve.a -lgcc_s -lutil -lrt -lpthread -lm -ldl
*/
import "C"
