#!/usr/bin/env bash
# Soak test through the C ABI: RSS must stay flat under steady load (not run in CI).
#
#   scripts/soak.sh                          # 30 minutes at 80% of capacity, RSS growth <= 1%
#   scripts/soak.sh --minutes 10 --load 0.5 --max-growth 2 DIR...
#
# Builds the release library (`cargo build --release --lib`) and ffi_examples/c/soak.c (with
# `cc`, into target/soak/), then runs it on the given model directories (default: the committed
# fixtures ffi_examples/testdata/mlp_4_8_3 and lstm_small). The program calibrates each model's
# capacity closed-loop, primes the runtime (every model at its admission bound at once, then a
# 10 s overload burst, so that the baseline holds the high-water marks the bounds allow and
# growth after it means a leak), then offers an open-loop Poisson load at --load times the mix's
# capacity from one submitter thread for --minutes, counting refused submits (BUSY) without retrying. It
# keeps an exactly-once ledger, checks every output, samples its RSS every 10 s, and fails if the
# RSS grew more than --max-growth percent from the end of warm-up (the first 60 s) to the end, if
# any request was lost, duplicated or completed with a code other than OK, or if shutdown with
# drain left anything pending. Its last lines are `soak summary: ...` (capacity, offered and
# achieved rates, refusals, completions by code, RSS at warm-up and end, growth) and `soak: ok`
# or `soak: FAILED`; this script exits with its status. Options after `--` go to the program
# (e.g. `-- --backend cuda --sample-seconds 30`; see the top of ffi_examples/c/soak.c).
# Each sample line also gives glibc's heap in use and held: with glibc's default per-thread
# arenas RSS can creep while the heap in use stays flat (the allocator keeping freed memory per
# thread); `MALLOC_ARENA_MAX=1 scripts/soak.sh` measures with one arena (ARCHITECTURE.md §9).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 [--minutes N] [--load F] [--max-growth PCT] [MODEL_DIR...] [-- SOAK_OPTIONS...]" >&2; exit 2; }
minutes=30 load=0.8 growth=1.0 models=() extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) [ $# -ge 2 ] || usage; minutes="$2"; shift 2 ;;
    --load) [ $# -ge 2 ] || usage; load="$2"; shift 2 ;;
    --max-growth) [ $# -ge 2 ] || usage; growth="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage ;;
    -*) echo "$0: unknown option $1" >&2; usage ;;
    *) models+=("$1"); shift ;;
  esac
done
case "$minutes" in
  ''|*[!0-9]*|0) echo "$0: --minutes must be a whole number of minutes, at least 1" >&2; exit 2 ;;
esac
# --load and --max-growth are validated by the program itself.

cargo build --release --lib
mkdir -p target/soak
cc -std=c11 -Wall -Wextra -Werror -pthread -O2 -I include ffi_examples/c/soak.c \
  -L target/release -lserve -lm -o target/soak/soak
# Run through the SONAME, as an installed consumer would.
ln -sf ../release/libserve.so target/soak/libserve.so.0

cmd=(target/soak/soak --seconds "$((minutes * 60))" --load "$load" --max-growth "$growth"
     ${extra[@]+"${extra[@]}"} ${models[@]+"${models[@]}"})
echo "running: ${cmd[*]}"
LD_LIBRARY_PATH="$PWD/target/soak${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "${cmd[@]}"
