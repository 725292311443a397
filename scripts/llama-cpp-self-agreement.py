#!/usr/bin/env python3
"""How far llama.cpp agrees with itself on the Q4_K_M fixtures: its greedy ids with its repacked
CPU kernels (llama-server's default) against the ids in tests/fixtures/families/*/reference.json,
which `make-family-fixtures.py` recorded with `--no-repack` (ggml's own vec-dots), same prompts,
same server flags otherwise. Where the two kernel paths part, llama.cpp's own rounding turns a
near tie, so "brigade's ids equal llama.cpp's" cannot be asked of those steps of any engine.

    scripts/llama-cpp-self-agreement.py LLAMA_SERVER [FAMILY ...]

Prints, per family and prompt, the leading ids each path shares with the fixture (the
`--no-repack` run first: it checks that the build reproduces the fixture). Needs the fixtures
script's imports (a venv with torch, transformers, sentencepiece, safetensors, numpy, gguf)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ["qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3moe", "qwen2moe", "olmoe"]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    server = Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("fixtures", ROOT / "scripts" / "make-family-fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    popen = subprocess.Popen
    for family in sys.argv[2:] or FAMILIES:
        name = f"{family}-tiny-Q4_K_M.gguf"
        cases = json.loads((ROOT / "tests/fixtures/families" / family / "reference.json").read_text())["llama_cpp"][name]
        for repack in (False, True):
            # the fixtures' llama_greedy with its `--no-repack` dropped for the repacked run
            fixtures.subprocess.Popen = (
                (lambda args, *a, **k: popen([x for x in args if x != "--no-repack"], *a, **k)) if repack else popen
            )
            got, _ = fixtures.llama_greedy(
                server, ROOT / "tests/fixtures/families" / family / name, prompts=[c["prompt_ids"] for c in cases], texts=[]
            )
            shared = []
            for g, c in zip(got, cases):
                a, b = g["greedy_ids"], c["greedy_ids"]
                shared.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            path = "repacked" if repack else "--no-repack"
            print(f"{family:9} {path:12} leading ids shared with the fixture: {shared} of {len(cases[0]['greedy_ids'])}")
        fixtures.subprocess.Popen = popen


if __name__ == "__main__":
    main()
