#!/usr/bin/env bash
# Every GPU test and GPU benchmark of libserve, in one call on a machine with an NVIDIA GPU
# (ARCHITECTURE.md §9). The GPU machine may have no Rust toolchain and no package registry, so
# the work is split in two:
#
#   scripts/gpu-verify.sh pack [DIR]   # here (toolchain, nvcc): build the release binaries of every
#                                      # GPU test and benchmark and the `serve` CLI into DIR
#                                      # (default .gpu, ignored by git), stripped
#   scripts/gpu-verify.sh run [DIR]    # there (GPU, no toolchain needed): run them all with
#                                      # SERVE_REQUIRE_GPU=1 and print one summary table
#   scripts/gpu-verify.sh              # both, on a machine that has a toolchain and a GPU
#
# `run` finds the CUDA libraries libserve dlopens (libcuda from the driver; libcublas.so.13 and
# libnvrtc.so.13 from a CUDA 13 toolkit or NVIDIA's pip wheels) and puts their folders on
# LD_LIBRARY_PATH. It runs, each under a time limit, so one hang cannot eat the whole call:
#   tests    cuda_layer, cuda_kernels, cuda_kernels_io, cuda_kernels_layers, cuda_nvrtc, gpu_e2e,
#            cuda_graphs (alone in its process: CUDA graphs on), the library's backend::cuda
#            unit tests
#   benches  benches/cuda.rs (LSTM step vs cuBLAS GEMM, completion latency, zero-copy lookup);
#            PyTorch's nn.LSTMCell on the same GPU where python3 has torch (the bench's baseline
#            slot); `serve bench step --backend cuda`; `serve profile` and `serve bench lstm` on
#            CUDA (their JSON reports let `serve sim --compare` check the simulator against the
#            GPU runtime afterwards); `serve bench layers resnet50|bert-base --backend cuda`
#            against PyTorch on the same GPU; `serve profile --engine-configs` and `serve bench
#            elastic` on CUDA (issue 15's E4 and E8 halves); `serve bench tenant` on the host's
#            cores (issue 16's scaled real run, CPU)
# Logs and reports go to a fresh folder (printed); with $OUT set (the device tool's return
# folder, at most 8 files come back) the step logs also go there as one gpu-verify-logs.tar.gz,
# beside summary.txt and the JSON reports.
# GPU_VERIFY_ONLY=REGEX runs only the steps whose names match (e.g. 'engine|elastic'), so a second
# call inside one lease can redo what the first left unfinished or found broken.
# Exit status: 0 when every step passed, 1 otherwise; the table says which failed.
set -uo pipefail
cd "$(dirname "$0")/.."

mode="${1:-all}"
dir="${2:-.gpu}"
case "$mode" in
  pack | run | all) ;;
  *) echo "usage: $0 [pack|run] [DIR]" >&2; exit 2 ;;
esac

# The test targets that exercise a GPU, and the benchmark.
gpu_tests=(cuda_layer cuda_kernels cuda_kernels_io cuda_kernels_layers cuda_nvrtc gpu_e2e cuda_graphs)

pack() {
  set -e
  local built
  echo "== building release test and benchmark binaries (nvcc: ${NVCC:-from PATH})"
  built="$(cargo test --release --locked --no-run --lib $(printf -- '--test %s ' "${gpu_tests[@]}") 2>&1)" \
    || { echo "$built" >&2; return 1; }
  local bench
  bench="$(cargo bench --locked --bench cuda --no-run 2>&1)" || { echo "$bench" >&2; return 1; }
  cargo build --release --locked --bin serve
  rm -rf "$dir"
  mkdir -p "$dir/bin"
  local t path
  for t in "${gpu_tests[@]}"; do
    path="$(sed -n "s|.*Executable tests/$t.rs (\(.*\))|\1|p" <<<"$built")"
    [ -n "$path" ] || { echo "no binary for tests/$t.rs" >&2; return 1; }
    cp "$path" "$dir/bin/test-$t"
  done
  path="$(sed -n "s|.*Executable unittests src/lib.rs (\(.*\))|\1|p" <<<"$built")"
  cp "$path" "$dir/bin/test-lib"
  path="$(sed -n "s|.*Executable benches/cuda.rs (\(.*\))|\1|p" <<<"$bench")"
  [ -n "$path" ] || { echo "no binary for benches/cuda.rs" >&2; return 1; }
  cp "$path" "$dir/bin/bench-cuda"
  cp target/release/serve "$dir/bin/serve"
  strip "$dir"/bin/* 2>/dev/null || true
  # Tests find their fixtures through the path of the checkout they were built in.
  pwd >"$dir/built-in"
  git rev-parse --short HEAD >"$dir/commit" 2>/dev/null || echo unknown >"$dir/commit"
  du -sh "$dir"
  set +e
}

# Prepend to LD_LIBRARY_PATH the folder of the first file named $1 under the usual CUDA places.
find_lib() {
  local name="$1" found
  if ldconfig -p 2>/dev/null | grep -q " $name "; then return 0; fi
  found="$(find /usr/local/cuda* /usr/local/nvidia /opt /usr/lib /usr/lib64 /usr/local/lib \
    -maxdepth 9 -name "$name" -print -quit 2>/dev/null)"
  if [ -n "$found" ]; then
    export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "  $name: $found"
  else
    echo "  $name: NOT FOUND"
  fi
}

results=()
failed=0
out=""

# step NAME LIMIT_S COMMAND…: run it, log to $out/NAME.log, record pass/fail and seconds.
step() {
  local name="$1" limit="$2" t0 rc secs log
  shift 2
  if [ -n "${GPU_VERIFY_ONLY:-}" ] && ! [[ $name =~ $GPU_VERIFY_ONLY ]]; then return 0; fi
  log="$out/$name.log"
  echo
  echo "=== $name ($*)"
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  local what="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    what="TIMEOUT (${limit} s)"
  elif [ "$rc" -ne 0 ]; then
    what="FAILED (exit $rc)"
  fi
  [ "$what" = ok ] || failed=1
  # A test binary's own tally: "test result: ok. N passed; M failed; …" summed over its lines.
  local tally
  tally="$(awk '/^test result:/ { p += $4; f += $6; i += $8 } END { if (NR && (p || f || i)) printf "%d passed, %d failed, %d ignored", p, f, i }' "$log")"
  local skips
  skips="$(grep -c '^skipped:' "$log")"
  [ "$skips" -eq 0 ] || tally="$tally, $skips SKIPPED"
  results+=("$(printf '%-22s %-18s %7s s  %s' "$name" "$what" "$secs" "$tally")")
  # What has run so far comes back even if the call is cut off later.
  printf '%s\n' "${results[@]}" >"$out/summary.txt"
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/gpu-verify-logs.tar.gz" -C "$out" $(cd "$out" && ls -- *.log)
    cp "$out/summary.txt" "$OUT/"
  fi
}

run() {
  local bin="$dir/bin"
  [ -x "$bin/test-gpu_e2e" ] || { echo "no binaries in $dir: run '$0 pack' first" >&2; return 1; }
  out="$(mktemp -d /tmp/gpu-verify.XXXXXX)"
  echo "== libserve GPU verification, binaries of commit $(cat "$dir/commit"), logs in $out"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
  echo "== CUDA libraries"
  find_lib libcublas.so.13
  find_lib libcublasLt.so.13
  find_lib libnvrtc.so.13
  # The tests read fixtures under the checkout they were built in: point that path here.
  local built_in
  built_in="$(cat "$dir/built-in")"
  if [ "$built_in" != "$(pwd)" ] && [ ! -e "$built_in" ]; then
    mkdir -p "$(dirname "$built_in")" && ln -s "$(pwd)" "$built_in" && echo "  linked $built_in -> $(pwd)"
  fi
  export SERVE_REQUIRE_GPU=1 SERVE_REQUIRE_NVRTC=1 RUST_BACKTRACE=1

  step info 20 "$bin/serve" info
  step test-cuda_layer 60 "$bin/test-cuda_layer" --nocapture
  step test-cuda_kernels 90 "$bin/test-cuda_kernels" --nocapture
  step test-cuda_kernels_io 60 "$bin/test-cuda_kernels_io" --nocapture
  step test-cuda_kernels_layers 60 "$bin/test-cuda_kernels_layers" --nocapture
  step test-cuda_nvrtc 60 "$bin/test-cuda_nvrtc" --nocapture
  step test-gpu_e2e 150 "$bin/test-gpu_e2e" --nocapture
  step test-cuda_graphs 60 "$bin/test-cuda_graphs" --nocapture
  step test-lib-cuda 30 "$bin/test-lib" backend::cuda
  # Issue 15's GPU halves (E4, E8): E-Ebird's co-run profile and the fixed-shape policies on CUDA
  # (their tables are in the step logs; no JSON, so the returned files stay within 8). They run
  # before the benchmarks that earlier calls have already measured.
  step profile-engine-cuda 120 "$bin/serve" profile ffi_examples/testdata/resnet_small --backend cuda \
    --engine-configs "$out/engine-configs-cuda.txt"
  step bench-elastic-cuda 200 "$bin/serve" bench elastic ffi_examples/testdata/resnet_small --backend cuda \
    --engine-configs "$out/engine-configs-cuda.txt" --duration-s 1 --probe-s 0.3
  # E4 and E8 at the paper's scale: torchvision's ResNet-152 (random weights, written by PyTorch
  # there; nothing travels), its 252 co-run configurations, then the policies at its capacity.
  if python3 -c 'import torch, torchvision, safetensors' 2>/dev/null; then
    step make-resnet152 60 python3 - "$out/resnet152" <<'PY'
import os, sys, torch, torchvision, safetensors.torch
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
torch.manual_seed(0)
m = torchvision.models.resnet152().eval()
sd = {k: v.contiguous() for k, v in m.state_dict().items() if v.dtype == torch.float32}
safetensors.torch.save_file(sd, os.path.join(d, "weights.safetensors"))
with open(os.path.join(d, "model.toml"), "w") as f:
    f.write('kind = "resnet"\nblock = "bottleneck"\nlayers = [3, 8, 36, 3]\nnum_classes = 1000\nimage = [3, 224, 224]\n')
print("wrote", d, sum(v.numel() for v in sd.values()), "parameters")
PY
    step profile-engine-resnet152 150 "$bin/serve" profile "$out/resnet152" --backend cuda \
      --engine-configs "$out/engine-configs-resnet152.txt"
    step bench-elastic-resnet152 200 "$bin/serve" bench elastic "$out/resnet152" --backend cuda \
      --engine-configs "$out/engine-configs-resnet152.txt" --duration-s 1 --probe-s 0.3
    # The same with task bodies replayed from CUDA graphs (opt-in, ARCHITECTURE.md §5.3): the
    # engine thread's launch calls, not the GPU, bound N-Ebird's small tasks without them.
    step bench-elastic-resnet152-graphs 120 env SERVE_CUDA_GRAPHS=1 "$bin/serve" bench elastic \
      "$out/resnet152" --backend cuda --policies opt-wait nebird --duration-s 1 --probe-s 0.3
  fi
  step bench-cuda 150 "$bin/bench-cuda" --bench
  if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    step torch-lstmcell 60 python3 - <<'PY'
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for B in (64, 512):
    c = torch.nn.LSTMCell(1024, 1024).cuda()
    x, h, s = (torch.randn(B, 1024, device="cuda") for _ in range(3))
    with torch.no_grad():
        for _ in range(50):
            c(x, (h, s))
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(1000):
            c(x, (h, s))
        e1.record()
        torch.cuda.synchronize()
    # elapsed_time is in ms for 1000 steps: the same figure is µs per step.
    print(f"torch nn.LSTMCell(1024, 1024) batch {B}: {e0.elapsed_time(e1):.1f} us per step")
PY
  fi
  step bench-step-cuda 30 "$bin/serve" bench step --backend cuda --hidden 1024 --batch 512 \
    --json "$out/bench-step-cuda.json"
  step profile-cuda 90 "$bin/serve" profile --random lstm --hidden 1024 --backend cuda \
    --json "$out/profile-cuda-lstm.json"
  step profile-cuda-layers 90 "$bin/serve" profile ffi_examples/testdata/resnet_small --backend cuda \
    --batches 1,8 --json "$out/profile-cuda-resnet.json"
  step bench-lstm-cuda 120 "$bin/serve" bench lstm --backend cuda --fractions 0.25,0.5,0.9 \
    --capacity-s 2 --duration-s 1.5 --json "$out/bench-cuda-lstm.json"
  step bench-resnet50-cuda 150 "$bin/serve" bench layers resnet50 --backend cuda --batches 1,8,32 \
    --min-time 1 --json "$out/bench-cuda-resnet50.json"
  step bench-bert-cuda 150 "$bin/serve" bench layers bert-base --backend cuda --batches 1,8,32 \
    --min-time 1 --json "$out/bench-cuda-bert.json"
  # Issue 16's scaled real run: VELTAIR's schemes on the host's 16 cores (the runtime's tenant
  # mode; CPU only, the table is in the step log).
  step bench-tenant-cpu 240 "$bin/serve" bench tenant --workload mix --duration-s 1 --steps 5


  echo
  echo "== summary (SERVE_REQUIRE_GPU=1; commit $(cat "$dir/commit"))"
  cat "$out/summary.txt"
  [ "$failed" -eq 0 ] && echo "all GPU steps passed" || echo "SOME GPU STEPS FAILED"
  if [ -n "${OUT:-}" ]; then cp "$out"/*.json "$OUT/" 2>/dev/null; fi
  return "$failed"
}

case "$mode" in
  pack) pack ;;
  run) run ;;
  all) pack && run ;;
esac
