#!/usr/bin/env bash
# brigade's read bandwidth probe beside a C streaming reader (scripts/read-bandwidth.c: AVX-512
# or AVX2 loads, eight accumulators), interleaved so that both see the same machine load.
# Not a test: the numbers go into reports (docs/performance.md, `brigade doctor`).
# Usage: scripts/compare-bandwidth.sh [threads=2] [MiB=512] [rounds=3]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
mib=${2:-512}
rounds=${3:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -O2 -march=native -pthread scripts/read-bandwidth.c -o "$out/read-bandwidth"
cargo build -q -p brigade-model --example read_bandwidth
probe=target/debug/examples/read_bandwidth
grep -m1 'model name' /proc/cpuinfo || true
for _ in $(seq "$rounds"); do
    "$out/read-bandwidth" "$threads" "$mib" 5
    "$probe" "$threads" "$mib" 5
done
