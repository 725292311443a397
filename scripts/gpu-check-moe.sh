#!/usr/bin/env bash
# Split layers of a mixture of experts on a CUDA machine (issue 27, items 3 and 5): attention on
# the GPU, experts in RAM (`--cpu-moe`, `--n-cpu-moe N`, and the split `-ngl auto` chooses), on
# a Qwen3-MoE of Qwen3-30B-A3B's widths cut to 12 layers and 64 experts (8 used), Q4_K, about
# 2.2 GB (synth takes about a minute). Writes under OUT: runs.jsonl (each run's JSON: ids, devices with predicted and
# measured GPU bytes and the experts held in RAM), bench*.json (the sweeps), and `*-ids:` lines
# in log.txt comparing the splits' greedy ids. `--headroom 0.99` leaves 1% of the GPU to
# `-ngl auto` (about 1.4 GB of an H200, 0.8 GB of an H100), less than the model's 2.2 GB: whole
# layers (about 0.17 GB each) fit only in part, so the planner should split. synth has no
# head-size flag: the heads are 64 wide, not Qwen3's 128. Budget: the step limits add up to 540 s;
# the cluster part (below) runs only if the rest left it time, within 580 s in all.
#
#   scripts/gpu-check-moe.sh BIN_DIR OUT_DIR     (BIN_DIR holds `brigade` built with --features cuda)
set -u
. "$(dirname "$0")/gpu-lib.sh"
compact() { # compact FILE...: each JSON file as one line of runs.jsonl (a missing one skipped)
  for f in "$@"; do [ -s "$f" ] && python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$f" >>"$OUT/runs.jsonl" 2>>"$OUT/log.txt"; done
}

log "start: $(nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1), $T CPU threads"
M=$W/moe-12l-64e.gguf
rm -f "$W"/cpu.json "$W"/gpu.json "$W"/cpu-moe.json "$W"/n6.json "$W"/auto.json
step synth 150 "$OUT/log.txt" "$BIN/brigade" synth -o "$M" --type q4_k --layers 12 --hidden 2048 --heads 32 --kv-heads 4 \
  --ffn 768 --experts 64 --experts-used 8 --vocab 151936 --moe-family qwen3moe
R=(run -m "$M" -p "Once upon a time" -n 48 --temp 0 --json -c 2048 -t "$T")
step run-cpu 60 "$W/cpu.json" "$BIN/brigade" "${R[@]}"
step run-gpu-whole 45 "$W/gpu.json" "$BIN/brigade" "${R[@]}" -ngl all
step run-gpu-cpu-moe 45 "$W/cpu-moe.json" "$BIN/brigade" "${R[@]}" -ngl all --cpu-moe
step run-gpu-n-cpu-moe-6 45 "$W/n6.json" "$BIN/brigade" "${R[@]}" -ngl all --n-cpu-moe 6
step run-auto-small-gpu 45 "$W/auto.json" "$BIN/brigade" "${R[@]}" -ngl auto --headroom 0.99
compact "$W"/cpu.json "$W"/gpu.json "$W"/cpu-moe.json "$W"/n6.json "$W"/auto.json
# the CPU computes the experts in f32 either way; the GPU computes the dense part in bf16
same cpu-moe-vs-gpu-whole "$W/cpu-moe.json" "$W/gpu.json"
same n6-vs-cpu-moe "$W/n6.json" "$W/cpu-moe.json"
same auto-vs-cpu-moe "$W/auto.json" "$W/cpu-moe.json"
same cpu-moe-vs-cpu "$W/cpu-moe.json" "$W/cpu.json"
# bench rows: all-CPU, all-GPU, dense-on-GPU/experts-on-CPU, --n-cpu-moe 6, and auto within 1% of the GPU
step bench-cpu 30 "$OUT/bench-cpu.json" "$BIN/brigade" bench -m "$M" -ngl 0 -p 512 -n 32 -r 1 -t "$T" -o json
step bench-gpu 90 "$OUT/bench.json" "$BIN/brigade" bench -m "$M" -ngl all -p 512 -n 64 -r 2 -t "$T" -o json \
  --n-cpu-moe 0,6,all
step bench-auto 30 "$OUT/bench-auto.json" "$BIN/brigade" bench -m "$M" -ngl auto --headroom 0.99 -p 512 -n 64 -r 2 -t "$T" -o json
# split layers in a cluster on loopback: a GPU gateway offering cuda0 and its CPU (whose RAM
# holds the experts of its split layers) and a CPU worker. By hand: the gateway's first 8 layers
# with the experts of 0-5 in its RAM, the CPU worker's last 4, against the single box's same
# split; then placed by the coordinator with no flag (it searches the split). GW_DEVICES,
# GW_DEVICE and BOX_SPLIT let the part run on a CPU build (cpu, cpu, nothing) to check the script.
if [ $SECONDS -lt 420 ]; then
  GWD=${GW_DEVICE:-cuda0}
  cluster_up "$W/cluster-moe"
  cluster_worker gw "${GW_DEVICES:-cuda0,cpu}"
  cluster_worker cpu cpu
  cluster_wait 2
  G=(-p "Once upon a time" -n 48 --temp 0 --json)
  left() { echo $(( $1 < 580 - SECONDS ? $1 : 580 - SECONDS )); }
  step cluster-deploy-split $(left 90) "$OUT/cluster.txt" "$BIN/brigade" deploy "${CL[@]}" --name split -m "$M" \
    --device-map "gw:$GWD:8,cpu:cpu:4" --n-cpu-moe 6 -c 2048
  step cluster-gen-split $(left 45) "$C/split.json" "$BIN/brigade" generate "${CL[@]}" --model split "${G[@]}"
  # (BOX_SPLIT: the single box's --device-map, `cuda0:8,cpu:4` on the GPU)
  read -r -a BOX <<<"${BOX_SPLIT---device-map cuda0:8,cpu:4}"
  step cluster-run-same-split $(left 45) "$C/box.json" "$BIN/brigade" run -m "$M" "${BOX[@]}" --n-cpu-moe 6 \
    -c 2048 -t "$T" "${G[@]}"
  same cluster-split "$C/split.json" "$C/box.json"
  step cluster-deploy-searched $(left 90) "$OUT/cluster.txt" "$BIN/brigade" deploy "${CL[@]}" --name searched -m "$M" -c 2048
  step cluster-gen-searched $(left 45) "$C/searched.json" "$BIN/brigade" generate "${CL[@]}" --model searched "${G[@]}"
  compact "$C/split.json" "$C/box.json" "$C/searched.json"
  kill $PIDS 2>/dev/null; wait 2>/dev/null
  for f in "$C"/*.log; do cp "$f" "$OUT/cluster-moe-$(basename "$f")"; done
else
  log "cluster part skipped: $SECONDS s used"
fi
rm -f "$M"
log "done"
