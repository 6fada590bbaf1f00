#!/usr/bin/env bash
# Fuzz libserve with cargo-fuzz (nightly toolchain, libFuzzer + AddressSanitizer).
#
#   scripts/fuzz.sh                 # every target for 1,000,000 executions (figures for the notes)
#   scripts/fuzz.sh --runs N        # every target for N executions
#   scripts/fuzz.sh --time S        # every target for S seconds (CI: --time 30)
#   scripts/fuzz.sh --time 60 c_abi # one target
#
# Targets (fuzz/fuzz_targets): `model_load` (model.toml + weights.safetensors bytes through
# serve::model::load), `c_abi` (random C-ABI call sequences: submit / cancel / shutdown / free /
# queue drain), `jsonl` (one `serve infer` input line through the request parser).
# Each target first replays its committed regressions (fuzz/regressions/TARGET: every input that
# ever crashed it), then fuzzes from a seed corpus made here from the committed fixtures. A crash
# fails the run and leaves the input in fuzz/artifacts/TARGET: commit it to
# fuzz/regressions/TARGET with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."

limit=(-runs=1000000)
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) limit=("-runs=$2"); shift 2 ;;
    --time) limit=("-max_total_time=$2"); shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(model_load c_abi jsonl)

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "cargo-fuzz is missing: cargo install --locked cargo-fuzz --version 0.13.2" >&2
  exit 1
fi

work=fuzz/corpus
mkdir -p "$work"
seed_model_load() {
  # model.toml's length (u16 LE), model.toml, weights.safetensors.
  local out=$1/seeds
  mkdir -p "$out"
  for d in ffi_examples/testdata/*/; do
    python3 - "$d" "$out/$(basename "$d")" <<'PY'
import struct, sys
d, out = sys.argv[1], sys.argv[2]
t = open(d + "model.toml", "rb").read()
w = open(d + "weights.safetensors", "rb").read()
open(out, "wb").write(struct.pack("<H", len(t)) + t + w)
PY
  done
}
seed_jsonl() {
  local out=$1/seeds
  mkdir -p "$out"
  printf '{"input":[0.5,-1.25,3,4e-3]}' > "$out/f32"
  printf '{"tokens":[1,2,3]}' > "$out/tokens"
  printf '{"tokens":[1,2,3],"parents":[-1,0,0]}' > "$out/tree"
}

for t in "${targets[@]}"; do
  corpus="$work/$t"
  mkdir -p "$corpus"
  case "$t" in
    model_load) seed_model_load "$corpus" ;;
    jsonl) seed_jsonl "$corpus" ;;
  esac
  # Bounded memory: a loader that allocates what a hostile header claims fails here.
  flags=(-rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=30)
  regressions="fuzz/regressions/$t"
  if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions")" ]; then
    echo "=== $t: replaying $(ls "$regressions" | wc -l) regression input(s)"
    cargo +nightly fuzz run "$t" "$regressions"/* -- "${flags[@]}"
  fi
  echo "=== $t: fuzzing (${limit[*]})"
  seeds=()
  [ -d "$corpus/seeds" ] && seeds=("$corpus/seeds")
  log="fuzz/artifacts/$t.log"
  mkdir -p fuzz/artifacts
  status=0
  cargo +nightly fuzz run "$t" "$corpus" "${seeds[@]}" -- "${flags[@]}" "${limit[@]}" -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  grep -E "^(#[0-9]+ +DONE|Done [0-9]+ runs|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)" "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -80 "$log"
    echo "fuzz target $t failed (exit $status): the input is in fuzz/artifacts/$t, the log in $log" >&2
    exit 1
  fi
done
