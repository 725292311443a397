#!/usr/bin/env bash
# Prefill of a prompt across a 100 Mbit/s link (part of scripts/bench-cluster.sh; needs root):
# two network namespaces, a veth pair slowed with tc tbf, a worker in each, the coordinator and
# the client with the first. Prints pp512 through the link beside its bound: the activation bytes
# (512 rows × hidden × 4 bytes) ÷ the link's bandwidth + the prompt's compute on one process.
set -euo pipefail
BIN=$(realpath "${1:-target/release/brigade}")
MODEL=$(realpath "${2:-/tmp/l1b-q4_k.gguf}")
RATE=${RATE:-100mbit}
P=bsl$$
A=${P}a; B=${P}b
DIR=$(mktemp -d)
cleanup() {
  for p in $(jobs -p); do kill -9 "$p" 2>/dev/null || true; done
  ip netns pids "$A" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns pids "$B" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
ip netns add "$A"; ip netns add "$B"
ip link add va netns "$A" type veth peer name vb netns "$B"
ip -n "$A" addr add 10.250.0.1/24 dev va; ip -n "$B" addr add 10.250.0.2/24 dev vb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set va up; ip -n "$B" link set vb up
ip netns exec "$A" tc qdisc add dev va root tbf rate "$RATE" burst 64kbit latency 400ms
ip netns exec "$B" tc qdisc add dev vb root tbf rate "$RATE" burst 64kbit latency 400ms
T=brg1-slowlink-0123456789abcdef
ip netns exec "$A" "$BIN" coordinator --listen 10.250.0.1:7070 --data-dir "$DIR/c" --join-token $T >"$DIR/c.log" 2>&1 &
sleep 1
ip netns exec "$A" "$BIN" worker --coordinator 10.250.0.1:7070 --listen 10.250.0.1:7071 --name w1 --join-token $T \
  --data-dir "$DIR/w1" --models-dir "$(dirname "$MODEL")" -t 2 --measure full >"$DIR/w1.log" 2>&1 &
ip netns exec "$B" "$BIN" worker --coordinator 10.250.0.1:7070 --listen 10.250.0.2:7071 --name w2 --join-token $T \
  --data-dir "$DIR/w2" --models-dir "$(dirname "$MODEL")" -t 2 --measure full >"$DIR/w2.log" 2>&1 &
CLI=(--coordinator 10.250.0.1:7070 --ca "$DIR/c/ca.pem")
run() { ip netns exec "$A" "$BIN" "$@" "${CLI[@]}"; }
for i in $(seq 1 600); do run status --json 2>/dev/null | grep -c '"state": "up"' | grep -qx 2 && break; sleep 0.5; done
run deploy -m "$MODEL" --name m --device-map w1:cpu:8,w2:cpu:8 --ctx 1024 >/dev/null
run status | grep -E "→" || true
run bench -m m -p 512 -n 0 -r 2 | tee "$DIR/pp.txt"
pp=$(grep pp512 "$DIR/pp.txt" | head -1 | awk -F'|' '{print $5}' | awk '{print $1}')
local_pp=$("$BIN" bench -m "$MODEL" -p 512 -n 0 -r 2 -t 2 -o json | python3 -c 'import json,sys; r=json.load(sys.stdin)["rows"]; print([x for x in r if x["test"]=="pp512"][0]["avg_ts"])')
bw=$(run status --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(min(l["bandwidth_bytes_per_s"] for l in s["links"]))')
python3 - "$pp" "$local_pp" "$bw" <<'PY'
import sys
pp, local, bw = map(float, sys.argv[1:])
act = 512 * 2048 * 4
bound = act / bw + 512 / local
print(f"pp512 across the link: {pp:.1f} t/s = {512/pp:.2f} s; bound (activations {act/1e6:.1f} MB / {bw/1e6:.1f} MB/s + compute {512/local:.2f} s): {bound:.2f} s → {512/bound:.1f} t/s; measured / bound time = {(512/pp)/bound:.2f}")
PY
