//go:build libserve_pkgconfig

package libserve

// Linking against an installed libserve, found through pkg-config (libserve.pc). Selected with
// `go build -tags libserve_pkgconfig`; the default (link_static.go) links the checkout's
// target/release/libserve.a instead. If the .pc file is not in a standard location, point
// PKG_CONFIG_PATH at its directory; if it names the shared library, make libserve.so.0 findable
// at run time (ld.so.conf, rpath or LD_LIBRARY_PATH).

// cgo runs `pkg-config --libs` without --static, so the native libraries a static-only install
// (install.sh --no-shared) needs are named here too, after a -lserve of their own (cgo puts these
// flags before pkg-config's, and GNU ld applies pkg-config's -L to every -l). They are
// libserve.pc's Libs.private (rustc's native-static-libs) and harmless for the shared library.

/*
#cgo pkg-config: libserve
#cgo LDFLAGS: -lserve -ldl -lgcc_s -lutil -lrt -lpthread -lm -ldl
*/
import "C"
