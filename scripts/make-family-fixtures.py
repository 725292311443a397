#!/usr/bin/env python3
"""Writes the tiny random-weight checkpoints of the model families brigade runs, and the
references brigade is tested against, with tools that are not brigade:

    scripts/make-family-fixtures.py --llama-cpp DIR [--out tests/fixtures/families] [--family qwen3]

(`--family mistral` alone needs no llama.cpp: see its entry in FAMILIES.)

    scripts/make-family-fixtures.py --llama-cpp DIR --bench OUT [--family phi3]

    scripts/make-family-fixtures.py --llama-cpp DIR --real target/models/gemma-3-270m-q4_k_m.gguf

writes llama.cpp's greedy ids and log-probabilities for a real (trained) checkpoint over text
prompts, one longer than a sliding window, from the file and from its weights dequantized to F32
(tests/fixtures/real).

writes, instead, each GGUF family at the size of BENCH (about 150M parameters) as OUT/<family>-
bench-Q4_K_M.gguf, for `brigade bench` beside `llama-bench` (random weights: the speed of the
shapes, not of a trained model).

For each family:
  1. a SentencePiece BPE tokenizer (512 pieces, byte fallback) trained on a short corpus;
  2. Hugging Face transformers builds the model from a config of a tiny size with random weights
     (seeded; the norms' weights randomised too so that each one matters) and saves it as a
     safetensors directory in float16;
  3. llama.cpp's own `convert_hf_to_gguf.py` turns that directory into an F16 GGUF, and
     `llama-quantize` the F16 GGUF into Q4_K_M;
  4. references: transformers' greedy ids (float32 compute on the float16 weights) with the gap
     between the best two logits at every step, and llama.cpp's greedy ids (llama-server,
     temperature 0, `return_tokens`) with its top-5 log-probabilities at every step, for each
     GGUF, over the same prompts given as token ids.

Needs torch, transformers, sentencepiece, safetensors, numpy and gguf (a venv), and a llama.cpp
tree built with llama-server and llama-quantize (DIR is its root; binaries under DIR/build/bin).
The output is what tests/fixtures/families holds; the tests read only that.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CORPUS = """Once upon a time there was a little robot who lived in a quiet town by the sea.
Every morning the robot walked to the harbour and counted the boats, one by one, and wrote
the numbers in a small blue book. The fishermen laughed, but the robot did not mind.
One day a storm came, and the boats did not come back. The robot climbed the lighthouse,
turned on the great lamp and waited all night. In the morning, one by one, the boats came home.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))
The cluster placed layers on every device: the GPU held attention, the CPU held the rest.
"""

N_GEN = 40

# Prompts as token ids inside the 512-id vocabulary (given as ids, so no tokenizer decides them):
# a short one, one longer than 32 tokens, and one that repeats a pattern.
PROMPTS = [
    [305, 17, 442, 98, 260],
    [(i * 37 + 11) % 500 + 3 for i in range(48)],
    [100, 200, 300, 400] * 6,
]

# What every family's tiny model shares.
TINY = dict(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Texts both tokenizers are checked on: words, spaces and newlines, code, and characters the
# 512 pieces only have as bytes.
TEXTS = [
    "Once upon a time there was a little robot.",
    "The quick brown fox\n  jumps over   the lazy dog!",
    "def add(a, b):\n    return a + b",
    "Grüße aus Köln, 東京 🙂",
]

# The bench size: every family's tiny fields with these instead.
BENCH = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64)

# The families: transformers' config class and fields, and whether llama.cpp's GGUF files and
# greedy ids are references for it.
FAMILIES = {
    # Mistral with a sliding window shorter than every prompt but the first (which crosses it
    # while decoding). transformers only: llama.cpp's converter writes Mistral as a Llama and no
    # window (llama.cpp runs it with full attention), so its ids are not a reference here.
    "mistral": {
        "config": "MistralConfig",
        "model": "MistralForCausalLM",
        "gguf": False,
        # the ids of the same weights with full attention too: the window must change them
        "compare_without_window": True,
        "fields": dict(
            TINY,
            intermediate_size=384,
            rope_theta=10_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=16,
        ),
    },
    # Llama: the family every other is measured beside (bench size only; its fixtures are
    # tests/fixtures/*.gguf and SmolLM2)
    "llama": {
        "config": "LlamaConfig",
        "model": "LlamaForCausalLM",
        "gguf": True,
        "bench_only": True,
        "fields": dict(TINY, intermediate_size=256, rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    },
    # Phi-3: q/k/v and gate/up stored as one matrix each (both in the checkpoint and in GGUF),
    # RoPE on halves; no window (llama.cpp turns Phi-3's off), as Phi-4's config has none.
    "phi3": {
        "config": "Phi3Config",
        "model": "Phi3ForCausalLM",
        "gguf": True,
        "fields": dict(
            TINY,
            intermediate_size=320,
            rope_theta=10_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=None,
            original_max_position_embeddings=4096,
        ),
    },
    # Gemma 2: Gemma 3's layer without QK-norm, local layers every other one (window 8, the global
    # RoPE base), attention scores soft-capped at 50 and the logits at 30 (the real values).
    # (What caps does on a random model: scores here are a few units, far below 50, so it is the
    # final cap that changes the numbers.)
    "gemma2": {
        "config": "Gemma2Config",
        "model": "Gemma2ForCausalLM",
        "gguf": True,
        # tied, as every Gemma 2 (llama.cpp's converter drops a separate head), with the embedding
        # at a fifth of the others' scale: the sqrt(hidden)-scaled embedding of the last token
        # would otherwise outweigh the layers and pick that token again at every step
        "norm_center": 0.0,
        "embedding_scale": 0.2,
        "fields": dict(
            TINY,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=384,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=8,
            rope_theta=10_000.0,
            rms_norm_eps=1e-6,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    },
    # Gemma 3 (text): pre- and post-norms of Gemma's (1 + w) kind, GeLU-tanh, the embedding scaled
    # by sqrt(hidden), QK-norm, and five local layers (window 8, RoPE base 10 000) before a global
    # one (base 1e6): six layers, so one of each pattern. The scores are scaled by
    # 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), which is what llama.cpp does for every
    # Gemma 3 but the 27B.
    "gemma3": {
        "config": "Gemma3TextConfig",
        "model": "Gemma3ForCausalLM",
        "gguf": True,
        "norm_center": 0.0,
        "fields": dict(
            TINY,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=384,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=8,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rms_norm_eps=1e-6,
            # untied: with a tied head the sqrt(hidden)-scaled embedding of the last token
            # dominates its own logit on random weights, and every prompt repeats its last token
            tie_word_embeddings=False,
        ),
    },
    "qwen3": {
        "config": "Qwen3Config",
        "model": "Qwen3ForCausalLM",
        "gguf": True,
        "fields": dict(
            TINY,
            intermediate_size=256,
            head_dim=64,  # heads x head_dim = 512 != hidden: the explicit head size is used
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            attention_bias=False,
        ),
    },
    # Mixtures of experts: eight experts of 128, two per token, on every layer. Mixtral's
    # checkpoint becomes a `llama` GGUF with stacked experts; Qwen3-MoE renormalises the two
    # weights (norm_topk_prob, as its released configs), Qwen2-MoE does not and adds a shared
    # expert gated by a sigmoid.
    "mixtral": {
        "config": "MixtralConfig",
        "model": "MixtralForCausalLM",
        "gguf": True,
        "fields": dict(
            TINY,
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=None,
            router_jitter_noise=0.0,
        ),
    },
    "qwen3moe": {
        "config": "Qwen3MoeConfig",
        "model": "Qwen3MoeForCausalLM",
        "gguf": True,
        "sentencepiece_vocab": "conversion.qwen:Qwen2MoeModel",
        "fields": dict(
            TINY,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=64,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
            attention_bias=False,
        ),
    },
    # OLMoE: q and k normed whole (not per head) before RoPE, top-k of the softmax without
    # renormalising. llama.cpp sizes the k norm by the hidden size (its OLMoE has as many kv heads
    # as heads, as the released model), so this one does too.
    "olmoe": {
        "config": "OlmoeConfig",
        "model": "OlmoeForCausalLM",
        "gguf": True,
        "sentencepiece_vocab": "conversion.olmo:OlmoeModel",
        # as many kv heads as heads at the bench size too (BENCH has 4 of 16)
        "bench_fields": dict(num_key_value_heads=16),
        "fields": dict(
            TINY,
            num_key_value_heads=8,
            intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rope_theta=10_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            clip_qkv=None,
            attention_bias=False,
        ),
    },
    "qwen2moe": {
        "config": "Qwen2MoeConfig",
        "model": "Qwen2MoeForCausalLM",
        "gguf": True,
        "sentencepiece_vocab": "conversion.qwen:Qwen2MoeModel",
        "fields": dict(
            TINY,
            intermediate_size=256,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
    },
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def train_tokenizer(work: Path) -> Path:
    import sentencepiece as spm

    text = work / "corpus.txt"
    text.write_text(CORPUS * 4)
    prefix = work / "tok"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=512,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return Path(str(prefix) + ".model")


def build_hf(family: str, spec: dict, tok_model: Path, out: Path, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, spec["config"])(**spec["fields"])
    model = getattr(transformers, spec["model"])(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # RMSNorm weights start at 1 (Gemma's at 0: it scales by 1 + w); randomise them so
                # a misplaced norm changes the ids
                p.copy_(spec.get("norm_center", 1.0) + 0.25 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.mul_(spec.get("embedding_scale", 1.0))
    model = model.to(torch.float16)
    model.config.torch_dtype = torch.float16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # the SentencePiece model under its usual name (the converter reads it), and transformers'
    # tokenizer.json made from it (brigade's directory loader reads that)
    shutil.copy(tok_model, out / "tokenizer.model")
    tok = transformers.LlamaTokenizer.from_pretrained(out, legacy=False, add_bos_token=False)
    tok.save_pretrained(out)
    return model


def hf_greedy(out: Path, family: str, spec: dict, window: bool = True):
    import torch
    import transformers

    model = getattr(transformers, spec["model"]).from_pretrained(out, dtype=torch.float32)
    model.eval()
    if not window:
        # the same weights with full attention: the ids a reader that ignores the window gives
        model.config.sliding_window = None
    cases = []
    for prompt in PROMPTS:
        ids = list(prompt)
        gaps = []
        with torch.no_grad():
            for _ in range(N_GEN):
                logits = model(torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2)
                gaps.append(round(float(top.values[0] - top.values[1]), 5))
                ids.append(int(top.indices[0]))
        cases.append({"prompt_ids": prompt, "greedy_ids": ids[len(prompt):], "top2_gap": gaps})
        log(f"  transformers {family}{'' if window else ' (no window)'}: min top-2 gap {min(gaps):.4f}")
    return cases


def hf_tokenize(out: Path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out)
    return [{"text": t, "ids": tok(t, add_special_tokens=True)["input_ids"]} for t in TEXTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_greedy(server: Path, gguf: Path, prompts=None, texts=None, ctx=512):
    """llama-server's greedy ids and top-5 log-probabilities for `prompts` (token id lists, or
    texts it tokenizes with the model's BOS), and its tokenization of `texts`."""
    prompts, texts = PROMPTS if prompts is None else prompts, TEXTS if texts is None else texts
    port = free_port()
    proc = subprocess.Popen(
        [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "-t", "2",
         "-np", "1", "--no-warmup",
         # ggml's own vec-dots: the repacked (AMX) buffers crash llama-server in these VMs
         "--no-repack"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"llama-server did not start for {gguf}")
            time.sleep(0.3)
        tokenized = []
        for text in texts:
            body = json.dumps({"content": text, "add_special": True}).encode()
            req = urllib.request.Request(url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                tokenized.append({"text": text, "ids": json.loads(r.read())["tokens"]})
        cases = []
        for prompt in prompts:
            if isinstance(prompt, str):
                body = json.dumps({"content": prompt, "add_special": True}).encode()
                req = urllib.request.Request(url + "/tokenize", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    prompt = json.loads(r.read())["tokens"]
            body = json.dumps({
                "prompt": prompt, "n_predict": N_GEN, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "return_tokens": True, "cache_prompt": False, "ignore_eos": True, "n_probs": 5,
            }).encode()
            req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())
            # llama.cpp's top 5 log-probabilities (softmax of its raw logits) at each step; the
            # server leaves out the steps of tokens it held back as incomplete UTF-8 (byte
            # tokens), so entries are matched to steps by their sampled id, and a step without
            # one is null
            top5, steps = [None] * len(got["tokens"]), iter(enumerate(got["tokens"]))
            for entry in got["completion_probabilities"]:
                for i, tok in steps:
                    if tok == entry["id"]:
                        top5[i] = [[t["id"], round(t["logprob"], 5)] for t in entry["top_logprobs"]]
                        break
            cases.append({"prompt_ids": prompt, "greedy_ids": got["tokens"], "top5_logprobs": top5})
        return cases, tokenized
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, help="needed by the families with GGUF references")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/families")
    ap.add_argument("--family", action="append")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--bench", type=Path, help="write bench-size Q4_K_M files here instead of fixtures")
    ap.add_argument("--real", type=Path, action="append",
                    help="a real checkpoint's GGUF: write llama.cpp's references for it to tests/fixtures/real")
    a = ap.parse_args()
    if a.real:
        return real_references(a)
    import torch
    import transformers

    if a.bench:
        return bench_models(a)

    for family in a.family or [f for f in FAMILIES if not FAMILIES[f].get("bench_only")]:
        spec = FAMILIES[family]
        if spec["gguf"] and a.llama_cpp is None:
            ap.error(f"{family} has llama.cpp references: --llama-cpp DIR is needed")
        log(f"{family}:")
        dest = a.out / family
        if dest.exists():
            shutil.rmtree(dest)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            tok = train_tokenizer(tmp)
            hf_dir = dest / "hf"
            build_hf(family, spec, tok, hf_dir, a.seed)
            ref = {
                "family": family,
                "made_by": {
                    "script": "scripts/make-family-fixtures.py",
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "llama_cpp": a.llama_cpp.name if spec["gguf"] else None,
                    "seed": a.seed,
                },
                "config": spec["fields"],
                "transformers": hf_greedy(hf_dir, family, spec),
                "transformers_tokenize": hf_tokenize(hf_dir),
                "llama_cpp": {},
            }
            if spec.get("compare_without_window"):
                ref["transformers_without_window"] = hf_greedy(hf_dir, family, spec, window=False)
            if spec["gguf"]:
                gguf_references(a.llama_cpp, family, hf_dir, dest, ref)
            # the converter's own side files are not needed by anyone
            for extra in ("generation_config.json",):
                (hf_dir / extra).unlink(missing_ok=True)
            (dest / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


# A real checkpoint's prompts: a short one, code, and a text longer than Gemma 3's 512-token
# sliding window (tests/fixtures/prompts/lighthouse.txt, about 800 tokens).
REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    (Path(__file__).resolve().parent.parent / "tests/fixtures/prompts/lighthouse.txt").read_text(),
]


def real_references(a):
    """llama.cpp's greedy ids and top-5 log-probabilities for a real checkpoint over REAL_PROMPTS,
    from the file itself and from its weights dequantized to F32 by `llama-quantize` (the exact
    math of the same weights): tests/fixtures/real/<file stem>.json, read by
    crates/model/tests/families.rs."""
    import hashlib
    out_dir = Path(__file__).resolve().parent.parent / "tests/fixtures/real"
    out_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = a.llama_cpp / "build" / "bin"
    for gguf in a.real:
        cases, _ = llama_greedy(bin_dir / "llama-server", gguf, prompts=REAL_PROMPTS, texts=[], ctx=2048)
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / "f32.gguf"
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            exact, _ = llama_greedy(bin_dir / "llama-server", f32, prompts=REAL_PROMPTS, texts=[], ctx=2048)
        for case, text in zip(cases, REAL_PROMPTS):
            case["prompt"] = text if len(text) < 200 else f"tests/fixtures/prompts/lighthouse.txt ({len(text)} chars)"
        ref = {
            "file": gguf.name,
            "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
            "made_by": {"script": "scripts/make-family-fixtures.py --real", "llama_cpp": a.llama_cpp.name},
            "llama_cpp": cases,
            "llama_cpp_f32": exact,
        }
        out = out_dir / (gguf.stem + ".json")
        out.write_text(json.dumps(ref, indent=1) + "\n")
        log(f"{out}: prompts of {[len(c['prompt_ids']) for c in cases]} tokens")


def bench_models(a):
    bin_dir = a.llama_cpp / "build" / "bin"
    a.bench.mkdir(parents=True, exist_ok=True)
    for family in a.family or [f for f in FAMILIES if FAMILIES[f]["gguf"]]:
        spec = dict(FAMILIES[family])
        spec["fields"] = {**spec["fields"], **BENCH, **spec.get("bench_fields", {})}
        if family == "gemma3":
            spec["fields"]["query_pre_attn_scalar"] = BENCH["head_dim"]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            build_hf(family, spec, train_tokenizer(tmp), tmp / "hf", a.seed)
            f16 = tmp / "f16.gguf"
            subprocess.run(converter(a.llama_cpp, family) + [str(tmp / "hf"), "--outtype", "f16", "--outfile", str(f16)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            out = a.bench / f"{family}-bench-Q4_K_M.gguf"
            subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(out), "Q4_K_M"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            log(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


# Runs llama.cpp's converter with one converter class reading the SentencePiece vocabulary, as
# its dense Qwen2 class does: its MoE classes read only a GPT-2 BPE tokenizer whose
# pre-tokenizer they recognise by hash, which the fixtures' 512-piece tokenizer is not. The
# weights, the metadata and the GGUF's tensors are the converter's own.
SENTENCEPIECE_CONVERTER = """
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).parent))
sys.path.insert(1, str(Path(script).parent / "gguf-py"))
import importlib
module, name = sys.argv.pop(1).split(":")
cls = getattr(importlib.import_module(module), name)
cls.set_vocab = lambda self: self._set_vocab_sentencepiece()
runpy.run_path(script, run_name="__main__")
"""


def converter(llama_cpp: Path, family: str) -> list:
    """llama.cpp's converter as a command, reading the SentencePiece vocabulary where the family's
    converter class would not (`SENTENCEPIECE_CONVERTER`)."""
    script = str(llama_cpp / "convert_hf_to_gguf.py")
    patched = FAMILIES[family].get("sentencepiece_vocab")
    if patched:
        return [sys.executable, "-c", SENTENCEPIECE_CONVERTER, script, patched]
    return [sys.executable, script]


def gguf_references(llama_cpp: Path, family: str, hf_dir: Path, dest: Path, ref: dict):
    bin_dir = llama_cpp / "build" / "bin"
    f16 = dest / f"{family}-tiny-F16.gguf"
    subprocess.run(converter(llama_cpp, family) + [str(hf_dir), "--outtype", "f16", "--outfile", str(f16)], check=True,
                   stdout=subprocess.DEVNULL)
    q4 = dest / f"{family}-tiny-Q4_K_M.gguf"
    subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(q4), "Q4_K_M"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for g in (f16, q4):
        ref["llama_cpp"][g.name], tokenized = llama_greedy(bin_dir / "llama-server", g)
        # the same tokenizer in both files
        ref["llama_cpp_tokenize"] = tokenized
        same = [c["greedy_ids"] == t["greedy_ids"] for c, t in zip(ref["llama_cpp"][g.name], ref["transformers"])]
        log(f"  llama.cpp {g.name}: equal to transformers per prompt {same}")


if __name__ == "__main__":
    main()
