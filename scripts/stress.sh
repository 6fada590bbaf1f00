#!/usr/bin/env bash
# The exactly-once stress tests at scale, in release mode.
#
#   scripts/stress.sh            # 1,000,000 requests per test
#   scripts/stress.sh N          # N requests per test
#
# Runs tests/runtime.rs `every_request_completes_exactly_once_under_stress` (mlp, 4 threads) and
# tests/recurrent.rs `every_recurrent_request_completes_exactly_once_under_stress` (lstm, seq2seq,
# treelstm under cellular batching, 3 threads) with SERVE_STRESS_REQUESTS=N: random cancels and
# deadlines, a shutdown in the middle; every admitted request must complete exactly once (OK,
# CANCELLED or DEADLINE_EXCEEDED), refused ones never, OK outputs match the references, and the
# runtime's counters match. Each test prints a `stress …:` line: requests, admitted, refused,
# completions by code, wall time, requests/s. `cargo test` runs the same tests at 10^5 requests
# each in a debug build. The bookkeeping is two bytes per request, so
# memory stays bounded at any N; with GNU time installed the test binaries' peak RSS is printed too.
set -euo pipefail
cd "$(dirname "$0")/.."

n="${1:-1000000}"
case "$n" in
  ''|*[!0-9]*) echo "usage: $0 [REQUESTS]" >&2; exit 2 ;;
esac

# Build once; run the test binaries themselves, so that the peak RSS is theirs, not cargo's.
built="$(cargo test --release --test runtime --test recurrent --no-run 2>&1)" || { echo "$built" >&2; exit 1; }
bin() { sed -n "s|.*Executable tests/$1.rs (\(.*\))|\1|p" <<<"$built"; }
timed=()
if [ -x /usr/bin/time ]; then timed=(/usr/bin/time -f '  wall %e s, peak RSS %M KiB'); fi

run() { # test-target test-name
  echo "== $1 $2: $n requests"
  SERVE_STRESS_REQUESTS="$n" ${timed[@]+"${timed[@]}"} "$(bin "$1")" "$2" --exact --nocapture
}

run runtime every_request_completes_exactly_once_under_stress
run recurrent every_recurrent_request_completes_exactly_once_under_stress
echo "exactly once: ok ($n requests per test)"
