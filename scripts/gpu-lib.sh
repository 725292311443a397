# What the device scripts share, sourced by scripts/gpu-check.sh and scripts/gpu-check-moe.sh:
# BIN (the folder of the CUDA build, the first argument), OUT (results, the second argument or
# $OUT), W (scratch models), the CUDA libraries on LD_LIBRARY_PATH, T (the CPU threads), and
# `log`, `step` and `same`; a loopback cluster's `cluster_up`, `cluster_worker` and `cluster_wait`.
BIN=$(cd "${1:-.gpu}" && pwd) || exit 1
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
same() { # same NAME A B: whether two JSON files' generated_ids are equal, logged
  python3 - "$2" "$3" <<'PY' 2>&1 | sed "s/^/$1-ids: /" | tee -a "$OUT/log.txt"
import json, sys
try:
    a, b = (json.load(open(f))["generated_ids"] for f in sys.argv[1:3])
except Exception as e:
    print(f"not compared ({type(e).__name__}: {e})")
    sys.exit()
if a == b:
    print("equal")
else:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"DIFFER at {i}: {a} vs {b}")
PY
}
cluster_up() { # cluster_up DIR: a coordinator on a free-ish loopback port with its data in DIR;
  # sets C, TOKEN, P, CL (the client's flags) and PIDS (every process started, for `kill`)
  C=$1; rm -rf "$C"; mkdir -p "$C"
  TOKEN=brg1-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
  P=$((20000 + RANDOM % 20000))
  "$BIN/brigade" coordinator --listen 127.0.0.1:$P --data-dir "$C/coord" --join-token "$TOKEN" >"$C/coord.log" 2>&1 &
  PIDS=$!
  CL=(--coordinator 127.0.0.1:$P --ca "$C/coord/ca.pem")
  sleep 3
}
cluster_worker() { # cluster_worker NAME DEVICES [FLAG...]: a worker of the cluster (its pid in $!)
  local name=$1 devices=$2; shift 2
  "$BIN/brigade" worker --coordinator 127.0.0.1:$P --listen 127.0.0.1:0 --name "$name" --devices "$devices" \
    --join-token "$TOKEN" --data-dir "$C/$name" --models-dir "$C/$name/models" --measure quick "$@" >"$C/$name.log" 2>&1 &
  PIDS="$PIDS $!"
}
cluster_wait() { # cluster_wait N: until N nodes are up (at most 60 s)
  for _ in $(seq 60); do
    [ "$("$BIN/brigade" status --json "${CL[@]}" 2>/dev/null | grep -c '"state": "up"')" -ge "$1" ] && return
    sleep 1
  done
}
