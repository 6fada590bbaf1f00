#!/usr/bin/env bash
# Run the C example under AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer.
#
# This is tests/c_example.rs with SERVE_C_SANITIZE=1: cargo builds libserve (libserve.a and
# libserve.so), the test generates an mlp model and its expected outputs, compiles
# ffi_examples/c/example.c with `-fsanitize=address,undefined -fno-omit-frame-pointer -g` against
# libserve.a and runs it with ASAN_OPTIONS=detect_leaks=1 and UBSAN_OPTIONS=halt_on_error=1 (the
# shared-library variant runs too, unsanitized). Any sanitizer report makes the example exit
# non-zero and the test fail; the report is printed.
#
# Usage: ffi_examples/c/run_asan.sh [cargo test options, e.g. --release]
# Needs a C compiler with the sanitizer runtimes (gcc: libasan, libubsan); CC selects it.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SERVE_C_SANITIZE=1
exec cargo test --test c_example "$@" -- --nocapture
