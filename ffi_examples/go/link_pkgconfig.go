//go:build libserve_pkgconfig

package libserve

// Linking against an installed libserve, found through pkg-config (libserve.pc). Selected with
// `go build -tags libserve_pkgconfig`; the default (link_static.go) links the checkout's
// target/release/libserve.a instead. If the .pc file is not in a standard location, point
// PKG_CONFIG_PATH at its directory; if it names the shared library, make libserve.so.0 findable
// at run time (ld.so.conf, rpath or LD_LIBRARY_PATH).

/*
#cgo pkg-config: libserve
*/
import "C"
