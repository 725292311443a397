#!/usr/bin/env bash
# Builds brigade with CUDA on a machine without a GPU or a system CUDA: installs the CUDA 13.0
# toolkit from PyPI into a virtual environment (about 1.2 GB, once), adds the unversioned library
# links the linker wants, builds a stub libcuda.so (no wheel ships the driver library; the real
# one is used at run time), then `cargo build --release --features cuda`.
#
#   scripts/build-cuda.sh                 # -> target/cuda/release/brigade
#   scripts/build-cuda.sh --tests         # also the GPU test binaries (cargo test --no-run)
#   CUDA_VENV=~/.cache/brigade-cuda13 CUDA_COMPUTE_CAP=90 scripts/build-cuda.sh
#
# Stay on nvcc 13.0: drivers of the 580 series refuse PTX from newer toolkits. The default
# compute capability is 90 (H100/H200); set CUDA_COMPUTE_CAP for other GPUs. The first build
# compiles candle's kernels with nvcc (about 10 minutes on 2 cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${CUDA_VENV:-$HOME/.cache/brigade-cuda13}
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "cuda-toolkit[nvcc,cccl,crt,nvvm,cudart,cublas,curand,nvrtc]==13.0.2"
cu=$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13)
(cd "$cu/lib" && for l in cublas cublasLt cudart nvrtc; do ln -sf "lib$l.so.13" "lib$l.so"; done && ln -sf libcurand.so.10 libcurand.so)
cd "$root"
cargo fetch --quiet
if [ ! -f "$cu/lib/stubs/libcuda.so" ]; then
  mkdir -p "$cu/lib/stubs"
  sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | tail -1)
  # every driver entry point cudarc may resolve, returning an error if ever called
  grep -o 'pub unsafe fn cu[A-Za-z0-9_]*' "$sys" | awk '{print $4}' | sort -u | awk '{print "int " $1 "(void){return 999;}"}' > "$cu/lib/stubs/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cu/lib/stubs/libcuda.so" "$cu/lib/stubs/libcuda_stub.c"
fi
export CUDA_HOME=$cu CUDA_PATH=$cu CUDA_ROOT=$cu NVCC=$cu/bin/nvcc PATH=$cu/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$cu/lib:$cu/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/cuda}
cargo build --release --features cuda -p brigade-cli
if [ "${1:-}" = "--tests" ]; then
  cargo test --release --features cuda -p brigade-model --test devices --no-run
fi
echo "built $CARGO_TARGET_DIR/release/brigade (CUDA, compute capability $CUDA_COMPUTE_CAP)" >&2
