#!/usr/bin/env bash
# The one script to run on a CUDA machine (built for the H200 with scripts/build-cuda.sh here).
# It makes its own models with `brigade synth`, runs the GPU tests, benchmarks the -ngl curve on
# a Llama-3-8B shape (32000-token vocabulary, the shape of the llama.cpp figures in the project's
# perf notes) at q4_k and f16, runs a small cluster with a GPU gateway (a coordinator and two
# workers on loopback: one offering cuda0, one its CPU), and writes its results under OUT.
# Budget: under 10 minutes (the cluster part runs only if the rest left time for it).
#
#   scripts/gpu-check.sh BIN_DIR OUT_DIR
#     BIN_DIR holds `brigade` and `devices-test` (the GPU test binary) built with --features cuda
set -u
. "$(dirname "$0")/gpu-lib.sh"

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
# 8. the cluster on the GPU machine: a coordinator and three workers on loopback, two offering
# cuda0 (GPU gateways sharing the one GPU), one its CPU only. A hand placement (GPU layers, then
# CPU layers) must give the greedy ids of the single box's same split; the planner's own
# placement is shown with its prediction; tokens/s of each beside the single box's; then the
# GPU worker that hosts the planned deployment's first stage is killed mid-generation: the
# deployment is re-placed, the session replayed, and its ids must equal the uninterrupted run's.
# Results: cluster.jsonl (the JSON of each generation), cluster.txt, and
# `cluster-*-ids: equal|DIFFER` lines in log.txt.
if [ $SECONDS -lt 480 ]; then
  cluster_up "$W/cluster"
  declare -A WPID
  for g in gpu gpu2; do
    cluster_worker $g cuda0 --gpu-memory 24GiB
    WPID[$g]=$!
  done
  cluster_worker cpu cpu
  cluster_wait 3
  step cluster-status 30 "$OUT/cluster.txt" "$BIN/brigade" status "${CL[@]}"
  step cluster-synth 120 "$OUT/log.txt" "$BIN/brigade" synth --preset llama-1b --vocab 32000 --type q4_k -o "$C/1b.gguf"
  step cluster-deploy-hand 180 "$OUT/cluster.txt" "$BIN/brigade" deploy "${CL[@]}" --name hand -m "$C/1b.gguf" --device-map gpu:cuda0:12,cpu:cpu:4
  step cluster-gen-hand 120 "$C/hand.json" "$BIN/brigade" generate "${CL[@]}" --model hand -p "Once upon a time" -n 64 --temp 0 --json
  step cluster-run-same-split 120 "$C/box.json" "$BIN/brigade" run -m "$C/1b.gguf" --device-map cuda0:12,cpu:4 -p "Once upon a time" -n 64 --temp 0 --json
  same cluster-hand "$C/hand.json" "$C/box.json"
  cat "$C/hand.json" "$C/box.json" >>"$OUT/cluster.jsonl"
  step cluster-deploy-planned 180 "$OUT/cluster.txt" "$BIN/brigade" deploy "${CL[@]}" --name planned -m "$C/1b.gguf"
  step cluster-gen-planned 120 "$OUT/cluster.jsonl" "$BIN/brigade" generate "${CL[@]}" --model planned -p "Once upon a time" -n 64 --temp 0 --json
  step cluster-run-all-gpu 120 "$OUT/cluster.jsonl" "$BIN/brigade" run -m "$C/1b.gguf" -ngl all -p "Once upon a time" -n 64 --temp 0 --json
  # failure: kill the GPU worker that hosts the planned deployment's first stage mid-generation
  step cluster-gen-long 120 "$C/long.json" "$BIN/brigade" generate "${CL[@]}" --model planned -p "Once upon a time" -n 256 --temp 0 --json
  first=$("$BIN/brigade" status --json "${CL[@]}" | python3 -c 'import json,sys; d=[d for d in json.load(sys.stdin)["deployments"] if d["name"]=="planned"][0]; print(d["stages"][0]["node"])')
  log "planned's first stage is on $first"
  if [ -n "${WPID[$first]:-}" ]; then
    ( timeout 180 "$BIN/brigade" generate "${CL[@]}" --model planned -p "Once upon a time" -n 256 --temp 0 --json >"$C/killed.json" 2>>"$OUT/log.txt" ) &
    G=$!
    sleep 1.5; kill -9 "${WPID[$first]}"; log "killed $first mid-generation"
    wait $G; log "cluster-gen-killed: exit $?"
    same cluster-failover "$C/killed.json" "$C/long.json"
    cat "$C/long.json" "$C/killed.json" >>"$OUT/cluster.jsonl"
  fi
  step cluster-status-after 30 "$OUT/cluster.txt" "$BIN/brigade" status "${CL[@]}"
  kill $PIDS 2>/dev/null; wait 2>/dev/null
  cp "$C"/*.log "$OUT/" 2>/dev/null
  rm -f "$C/1b.gguf"
else
  log "cluster part skipped: $SECONDS s used"
fi
log "done"
