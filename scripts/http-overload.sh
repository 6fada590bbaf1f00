#!/usr/bin/env bash
# Drive the Go example server (ffi_examples/go/cmd/serve-http) with a real HTTP load generator
# (vegeta) on loopback: measure its capacity closed-loop, then attack it open-loop at a multiple
# of that capacity and report throughput, p50/p99 latency of the 200s and the share of each
# status. Not run in CI; bounded in time (about 10 s + DURATION per model).
#
#   scripts/http-overload.sh [--ref REF] [--rate R] [--duration Ns] [--factor F] [MODEL ...]
#
# MODEL is a model directory, or `heavy` for a generated 1024-4096-4096-1024 mlp (96 MB of
# weights, made in a temporary directory and removed at the end); default:
# ffi_examples/testdata/mlp_4_8_3 and heavy. --ref builds the server of git revision REF
# (its ffi_examples/go, linked with this checkout's target/release/libserve.a) to compare with
# the current one. --rate fixes the attack rate instead of FACTOR (default 2) × the measured
# capacity. Extra server flags: SERVE_HTTP_FLAGS (e.g. "-qos 100ms"); SERVER_CPUS and
# LOADGEN_CPUS (taskset lists, e.g. 0 and 1) pin the server and vegeta apart; SERVER_LOG keeps
# the server's log (default: discarded with the temporary directory). Needs go, python3 and
# vegeta (go install github.com/tsenart/vegeta/v12@latest; found on PATH or in $(go env
# GOPATH)/bin); build libserve first: cargo build --release --lib.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
ref="" rate="" duration=20s factor=2 models=()
while (($#)); do
	case $1 in
	--ref) ref=$2; shift 2 ;;
	--rate) rate=$2; shift 2 ;;
	--duration) duration=$2; shift 2 ;;
	--factor) factor=$2; shift 2 ;;
	-h | --help) sed -n '2,18p' "$0"; exit 0 ;;
	*) models+=("$1"); shift ;;
	esac
done
((${#models[@]})) || models=("$root/ffi_examples/testdata/mlp_4_8_3" heavy)

vegeta=$(command -v vegeta || echo "$(go env GOPATH)/bin/vegeta")
[[ -x $vegeta ]] || { echo "no vegeta: go install github.com/tsenart/vegeta/v12@latest" >&2; exit 1; }
pin_server=() pin_loadgen=()
[[ -n ${SERVER_CPUS:-} ]] && pin_server=(taskset -c "$SERVER_CPUS")
[[ -n ${LOADGEN_CPUS:-} ]] && pin_loadgen=(taskset -c "$LOADGEN_CPUS")
[[ -f $root/target/release/libserve.a ]] || { echo "build libserve first: cargo build --release --lib" >&2; exit 1; }

work=$(mktemp -d)
server_pid=""
cleanup() {
	[[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
	rm -rf "$work"
}
trap cleanup EXIT

# The server binary: this checkout's, or REF's linked with this checkout's libserve.a.
src=$root
if [[ -n $ref ]]; then
	src=$work/src
	mkdir -p "$src"
	git -C "$root" archive "$ref" ffi_examples/go include | tar -x -C "$src"
	ln -s "$root/target" "$src/target"
fi
(cd "$src/ffi_examples/go" && CGO_ENABLED=1 GOTOOLCHAIN=local go build -o "$work/serve-http" ./cmd/serve-http)
echo "server: ${ref:-this checkout} ($(git -C "$root" rev-parse --short "${ref:-HEAD}")), flags: ${SERVE_HTTP_FLAGS:-none}, CPUs: server ${SERVER_CPUS:-any}, vegeta ${LOADGEN_CPUS:-any}"

make_heavy() { # a 1024-4096-4096-1024 mlp with small deterministic weights
	mkdir -p "$1"
	printf 'kind = "mlp"\ninput = 1024\noutput = 1024\n' >"$1/model.toml"
	python3 - "$1/weights.safetensors" <<'EOF'
import array, json, struct, sys
sizes = [1024, 4096, 4096, 1024]
pattern = array.array("f", [((i * 7919) % 997 - 498) * 2e-5 for i in range(4096)])
header, blobs, off = {}, [], 0
for k in range(len(sizes) - 1):
    for name, shape in ((f"layers.{k}.weight", [sizes[k + 1], sizes[k]]), (f"layers.{k}.bias", [sizes[k + 1]])):
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        blob = (pattern * (n // 4096 + 1))[:n].tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for b in blobs:
        f.write(b)
EOF
}

port=18080
for model in "${models[@]}"; do
	if [[ $model == heavy ]]; then
		model=$work/heavy_mlp
		make_heavy "$model"
	fi
	# shellcheck disable=SC2086 # SERVE_HTTP_FLAGS is a list of flags
	"${pin_server[@]}" "$work/serve-http" -model "$model" -addr "127.0.0.1:$port" ${SERVE_HTTP_FLAGS:-} 2>"${SERVER_LOG:-$work/server.log}" &
	server_pid=$!
	for _ in $(seq 100); do curl -sf "127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
	info=$(curl -sf "127.0.0.1:$port/v1/model")
	python3 - "$info" >"$work/body.json" <<'EOF'
import json, sys
m = json.loads(sys.argv[1])
if m["kind"] == "mlp":
    body = {"input": [((i % 13) - 6) / 8 for i in range(m["input_len"])]}
elif m["kind"] == "treelstm":
    body = {"tokens": [3, 5, 7, 4294967295, 9], "parents": [-1, 0, 0, 1, 1]}
else:
    body = {"tokens": [3, 5, 7, 9, 11, 13, 15, 17]}
json.dump(body, sys.stdout)
EOF
	target="POST http://127.0.0.1:$port/v1/infer
Content-Type: application/json
@$work/body.json"

	report() { # vegeta results on stdin → one summary line
		"$vegeta" encode --to json | python3 -c '
import json, sys
ok, codes, errs, n = [], {}, {}, 0
for line in sys.stdin:
    r = json.loads(line)
    n += 1
    codes[r["code"]] = codes.get(r["code"], 0) + 1
    if r["code"] == 0:
        e = r["error"].split(": ")[-1]
        errs[e] = errs.get(e, 0) + 1
    if r["code"] == 200:
        ok.append(r["latency"] / 1e6)
ok.sort()
pct = lambda p: ok[min(len(ok) - 1, int(len(ok) * p / 100))] if ok else float("nan")
dur = float(sys.argv[1])
share = ", ".join(f"{c}: {100 * k / n:.1f}%" for c, k in sorted(codes.items()))
print(f"  {n} requests ({n / dur:.0f}/s): 200s {len(ok) / dur:.0f}/s, p50 {pct(50):.1f} ms, p99 {pct(99):.1f} ms; {share}")
for e, k in sorted(errs.items(), key=lambda x: -x[1])[:3]:
    print(f"    status 0 (no answer) {k}×: {e}")
' "$1"
	}

	echo "model $(basename "$model"): $info"
	# Capacity: closed loop, 64 concurrent clients, 5 s.
	cap_out=$(echo "$target" | "${pin_loadgen[@]}" "$vegeta" attack -rate=0 -max-workers=64 -duration=5s -timeout=30s | report 5)
	echo "  capacity run (closed loop, 64 clients, 5 s):"
	echo "$cap_out"
	capacity=$(sed -n 's/.*200s \([0-9]*\)\/s.*/\1/p' <<<"$cap_out")
	r=${rate:-$((capacity * factor))}
	secs=${duration%s}
	echo "  open loop at $r/s for $duration:"
	echo "$target" | "${pin_loadgen[@]}" "$vegeta" attack -rate="$r" -duration="$duration" -timeout=30s -max-connections=10000 | report "$secs"
	kill "$server_pid"
	wait "$server_pid" 2>/dev/null || true
	server_pid=""
	port=$((port + 1))
done
