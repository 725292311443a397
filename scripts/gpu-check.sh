#!/usr/bin/env bash
# The one script to run on a CUDA machine (built for the H200 with scripts/build-cuda.sh here).
# It makes its own models with `brigade synth`, runs the GPU tests, benchmarks the -ngl curve on
# a Llama-3-8B shape (32000-token vocabulary, the shape of the llama.cpp figures in the project's
# perf notes) at q4_k and f16, and writes its results under OUT. Budget: under 8 minutes.
#
#   scripts/gpu-check.sh BIN_DIR OUT_DIR
#     BIN_DIR holds `brigade` and `devices-test` (the GPU test binary) built with --features cuda
set -u
BIN=$(cd "${1:-.gpu}" && pwd)
OUT=${2:-${OUT:-/tmp/brigade-gpu-out}}
W=${BRIGADE_WORK:-/tmp/brigade-gpu-models}
mkdir -p "$OUT" "$W"
LIB=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
export LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
T=$(nproc)
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/log.txt"; }
step() { # step NAME TIMEOUT_S OUTFILE CMD...: run, log its exit status and time, keep going
  local name=$1 limit=$2 out=$3; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$out" 2>>"$OUT/log.txt"
  local rc=$?
  log "$name: exit $rc in $((SECONDS - t0)) s"
  return $rc
}

log "start: $(nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1), $T CPU threads"

# 1. smoke: the embedded model on the GPU gives the CPU's tokens
step smoke-cpu 60 "$OUT/runs.jsonl" "$BIN/brigade" run -n 40 --temp 0 --json
step smoke-gpu 60 "$OUT/runs.jsonl" "$BIN/brigade" run -n 40 --temp 0 --json --device-map cuda0:5
step smoke-split 60 "$OUT/runs.jsonl" "$BIN/brigade" run -n 40 --temp 0 --json --device-map cpu:2,cuda0:3

# 2. the GPU tests (test_device! bodies on cpu and cuda0)
step tests 240 "$OUT/tests.txt" "$BIN/devices-test" --test-threads 1 --nocapture

# 3. models
step synth-q4k 180 "$OUT/log.txt" "$BIN/brigade" synth --preset llama-8b --vocab 32000 --type q4_k -o "$W/8b-q4k.gguf"

# 4. -ngl auto on the real GPU: what it chose, predicted vs measured bytes
step auto-q4k 120 "$OUT/runs.jsonl" "$BIN/brigade" run -m "$W/8b-q4k.gguf" -ngl auto -p "Once upon a time" -n 64 --temp 0 --json -c 4096

# 5. per-token overhead: a 5-layer model whose compute is negligible, all on the GPU
step overhead 60 "$OUT/bench-small.json" "$BIN/brigade" bench -ngl all -p 64 -n 128 -r 3 -o json

# 6. the hybrid curve, q4_k (llama.cpp: tg128 16.1 / 20.7 / 29.1 / 51.1 / 75.4 / 111.5 / 142.1 / - / 274.9)
step bench-q4k 270 "$OUT/bench-q4k.json" "$BIN/brigade" bench -m "$W/8b-q4k.gguf" -ngl all,31,30,28,24,16,8,0,auto -p 512 -n 128 -r 1 -t "$T" -o json
rm -f "$W/8b-q4k.gguf"

# 7. f16 (llama.cpp: tg64 6.05 at 0 / 8.2 at 8 / 11.1 at 16 / 20.0 at 24 / 219.8 all)
if [ $SECONDS -lt 330 ]; then
  step synth-f16 120 "$OUT/log.txt" "$BIN/brigade" synth --preset llama-8b --vocab 32000 --type f16 -o "$W/8b-f16.gguf"
  step bench-f16 $((460 - SECONDS)) "$OUT/bench-f16.json" "$BIN/brigade" bench -m "$W/8b-f16.gguf" -ngl all,24 -p 512 -n 64 -r 1 -t "$T" -o json
else
  log "f16 skipped: $SECONDS s used"
fi
log "done"
