#!/usr/bin/env bash
# The cluster benchmark of issue 8 (a note, not a test): on a `brigade synth --preset llama-1b
# --type q4_k` model, on this machine's loopback and network namespaces,
#   1. tg128 and pp128/pp512 through 1, 2 and 3 stages against one process, in the same run;
#      the per-token split of compute per stage and transfer per hop;
#   2. pp512 with and without micro-batch overlap (chunks of 64 vs one chunk of 512);
#   3. prefill across a 100 Mbit/s tbf link against its bound (activation bytes / bandwidth +
#      compute);
#   4. pipelining: two workers pinned to one core each, 4 concurrent sessions, against one
#      process on one core.
# Usage: scripts/bench-cluster.sh [BIN] [MODEL]     (root needed for part 3)
set -euo pipefail
BIN=${1:-target/release/brigade}
MODEL=${2:-/tmp/l1b-q4_k.gguf}
OUT=${OUT:-/tmp/bench-cluster}
REPS=${REPS:-2}
mkdir -p "$OUT"
[ -f "$MODEL" ] || "$BIN" synth --preset llama-1b --vocab 32000 --type q4_k -o "$MODEL"
lscpu | grep -E "Model name|Flags" | sed 's/^/# /' | cut -c1-200
while pgrep -x rustc >/dev/null; do echo "# waiting for builds to finish" >&2; sleep 20; done

TOKEN=brg1-bench-$(date +%s)-0123456789abcdef
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# start_cluster NAME N_WORKERS [taskset cores per worker…]: a coordinator and workers (-t given by
# THREADS), the model deployed across the workers by hand (DEPLOY_ARGS adds options)
start_cluster() {
  local name=$1 n=$2; shift 2
  local dir=$OUT/$name; rm -rf "$dir"; mkdir -p "$dir"
  local port=$((20000 + RANDOM % 20000))
  "$BIN" coordinator --listen 127.0.0.1:$port --data-dir "$dir/c" --join-token "$TOKEN" >"$dir/c.log" 2>&1 &
  PIDS+=($!)
  for i in $(seq 1 50); do [ -f "$dir/c/coordinator.addr" ] && break; sleep 0.1; done
  for w in $(seq 1 "$n"); do
    local pin=()
    if [ $# -ge "$w" ]; then pin=(taskset -c "${!w}"); fi
    "${pin[@]}" "$BIN" worker --coordinator 127.0.0.1:$port --listen 127.0.0.1:0 --name w$w --join-token "$TOKEN" \
      --data-dir "$dir/w$w" --models-dir "$(dirname "$MODEL")" -t "${THREADS:-2}" --measure full >"$dir/w$w.log" 2>&1 &
    PIDS+=($!)
  done
  CLI=(--coordinator 127.0.0.1:$port --ca "$dir/c/ca.pem")
  for i in $(seq 1 600); do
    "$BIN" status --json "${CLI[@]}" 2>/dev/null | grep -c '"state": "up"' | grep -qx "$n" && break; sleep 0.5
  done
  local layers=16 map="" per=$((16 / n)) at=0
  for w in $(seq 1 "$n"); do
    local k=$per; [ "$w" -eq "$n" ] && k=$((layers - at))
    map+="w$w:cpu:$k,"; at=$((at + k))
  done
  "$BIN" deploy "${CLI[@]}" -m "$MODEL" --name m --device-map "${map%,}" --ctx 1024 --sessions 4 ${DEPLOY_ARGS:-} >"$dir/deploy.txt"
}

stop_cluster() { cleanup; PIDS=(); sleep 1; }

echo "## 1. one process vs 1, 2, 3 stages (loopback), -t 2"
"$BIN" bench -m "$MODEL" -p 128,512 -n 128 -r "$REPS" -t 2 -o json >"$OUT/local.json"
"$BIN" bench -m "$MODEL" -p 128,512 -n 128 -r "$REPS" -t 2 | tee "$OUT/local.txt"
for n in 1 2 3; do
  start_cluster stages$n $n
  "$BIN" bench "${CLI[@]}" -m m -p 128,512 -n 128 -r "$REPS" -o json >"$OUT/stages$n.json"
  "$BIN" bench "${CLI[@]}" -m m -p 128,512 -n 128 -r "$REPS" | tee "$OUT/stages$n.txt"
  "$BIN" status "${CLI[@]}" | grep -E "decode predicted" | tee -a "$OUT/stages$n.txt"
  stop_cluster
done

echo "## 2. pp512 through 2 stages: micro-batches of 64 (overlapping) vs one chunk of 512"
for ub in 64 512; do
  DEPLOY_ARGS="--ubatch $ub" start_cluster ubatch$ub 2
  "$BIN" bench "${CLI[@]}" -m m -p 512 -n 0 -r "$REPS" | tee "$OUT/ubatch$ub.txt"
  stop_cluster
done

echo "## 4. pipelining: 2 workers on one core each (-t 1), 4 sessions, vs one process on one core"
taskset -c 0 "$BIN" bench -m "$MODEL" -p 0 -n 64 -r "$REPS" -t 1 | tee "$OUT/onecore.txt"
THREADS=1 start_cluster pinned 2 0 1
"$BIN" bench "${CLI[@]}" -m m -p 0 -n 64 -r "$REPS" --concurrency 1,4,8 | tee "$OUT/pinned.txt"
stop_cluster

if [ "$(id -u)" = 0 ]; then
  echo "## 3. prefill across a 100 Mbit/s link (network namespaces, tc tbf)"
  bash "$(dirname "$0")/bench-slow-link.sh" "$BIN" "$MODEL" | tee "$OUT/slowlink.txt"
fi
