#!/usr/bin/env python3
"""brigade against llama.cpp on the same GGUF files, same thread count, runs interleaved.

    scripts/compare-llamacpp.py [-p 128] [-n 64] [-r 3] [-t 2] [--rounds 2] [--wait-quiet 600] \
        [--kernels auto,avx2] [--brigade target/release/brigade] [--baseline OTHER] MODEL.gguf...
    scripts/compare-llamacpp.py quantize IN.gguf OUT.gguf q4_k_m     # llama.cpp's quantizer

llama.cpp comes from llama-cpp-python (its low-level API, in a child process per run), built
for the CPU as in the README (`/work/venv-llama` by default, `--python` to change). Each round
runs brigade (once per `--kernels` setting, through BRIGADE_CPU_KERNELS) and then llama.cpp on
every model; the table gives means over rounds and the ratio brigade / llama.cpp. Other builds on
the machine move these numbers by tens of percent: `--wait-quiet S` waits (up to S seconds) before
every run until no compiler has run for 15 s.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

DEFAULT_PYTHON = "/work/venv-llama/bin/python"


def cpu_summary():
    """The CPU's model name and the vector extensions the kernels care about."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8"]
    return f"{model} ({os.cpu_count()} CPUs; {' '.join(f for f in wanted if f in flags)})"


def busy():
    """Whether a compiler runs on this machine now."""
    for name in ("rustc", "cc1", "cc1plus", "ld"):
        if subprocess.run(["pgrep", "-x", name], capture_output=True).returncode == 0:
            return True
    return False


def wait_quiet(limit):
    """Waits until no compiler has run for 15 s, at most `limit` seconds; says if it gave up."""
    end = time.time() + limit
    while time.time() < end:
        if not busy():
            time.sleep(15)
            if not busy():
                return
        time.sleep(10)
    if limit > 0:
        print(f"the machine stayed busy for {limit} s; measuring anyway", file=sys.stderr)


def llama_worker(args):
    """Runs in the child: pp and tg of one model with llama.cpp, prints JSON samples."""
    import ctypes

    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        sys.exit(f"llama.cpp cannot load {args.model}")
    cp = L.llama_context_default_params()
    cp.n_ctx = args.n_prompt + args.n_gen + 16
    cp.n_batch = max(args.n_prompt, 1)
    cp.n_ubatch = max(min(args.n_prompt, 512), 1)
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(max(args.n_prompt, 1), 0, 1)
    rng = random.Random(1)

    def decode(tokens, pos0):
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == len(tokens) - 1 else 0
        if L.llama_decode(ctx, batch) != 0:
            sys.exit("llama_decode failed")
        L.llama_synchronize(ctx)

    # warm-up, as llama-bench does
    decode([rng.randrange(vocab) for _ in range(min(args.n_prompt, 8) or 1)], 0)
    L.llama_memory_clear(mem, True)
    out = {"pp": [], "tg": []}
    for _ in range(args.reps):
        if args.n_prompt:
            L.llama_memory_clear(mem, True)
            toks = [rng.randrange(vocab) for _ in range(args.n_prompt)]
            t0 = time.perf_counter()
            decode(toks, 0)
            out["pp"].append(args.n_prompt / (time.perf_counter() - t0))
        if args.n_gen:
            L.llama_memory_clear(mem, True)
            t0 = time.perf_counter()
            for i in range(args.n_gen):
                decode([rng.randrange(vocab)], i)
            out["tg"].append(args.n_gen / (time.perf_counter() - t0))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    del ctypes
    print(json.dumps(out))


def run(what, cmd, env=None):
    """Runs one engine; a failure ends the comparison with what failed and why, not a traceback."""
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        why = f"exit status {res.returncode}"
        if res.returncode < 0:
            why = f"signal {-res.returncode}"
            if -res.returncode == 4:
                why += " (SIGILL: built for instructions this CPU does not have? compare its CMAKE_ARGS with lscpu's flags)"
        tail = "\n".join(res.stderr.strip().splitlines()[-5:])
        sys.exit(f"{what} failed: {why}\n  {' '.join(cmd)}\n{tail}")
    return res.stdout


def run_llama(args, model):
    cmd = [args.python, os.path.abspath(__file__), "--llama-worker", "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", str(args.reps), "-t", str(args.threads), model]
    return json.loads(run(f"llama.cpp on {model}", cmd).strip().splitlines()[-1])


def run_brigade(args, model, kernels, binary=None):
    env = dict(os.environ)
    if kernels != "auto":
        env["BRIGADE_CPU_KERNELS"] = kernels
    cmd = [binary or args.brigade, "bench", "-m", model, "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.reps),
           "-t", str(args.threads), "--no-bandwidth", "-o", "json"]
    out = json.loads(run(f"brigade ({kernels}) on {model}", cmd, env))
    samples = {"pp": [], "tg": []}
    for row in out["rows"]:
        samples["pp" if row["n_prompt"] else "tg"].extend(row["samples_ts"])
    return samples, out.get("notes", [])


def quantize(argv):
    import llama_cpp as L

    if len(argv) != 3:
        sys.exit("usage: compare-llamacpp.py quantize IN.gguf OUT.gguf q4_k_m|q8_0|q4_0|q6_k|...")
    src, dst, ftype = argv
    name = f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}"
    if not hasattr(L, name):
        sys.exit(f"llama.cpp has no {name}")
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, name)
    params.nthread = os.cpu_count() or 1
    if L.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        sys.exit("llama_model_quantize failed")


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "quantize":
        return quantize(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every engine")
    ap.add_argument("--kernels", default="auto", help="BRIGADE_CPU_KERNELS settings to run, comma separated")
    ap.add_argument("--brigade", default="target/release/brigade")
    ap.add_argument("--baseline", help="another brigade binary to run beside, under each --kernels setting (e.g. one built from main)")
    ap.add_argument("--python", default=DEFAULT_PYTHON, help="a python with llama-cpp-python")
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                    help="before each run, wait up to S seconds for no compiler to run")
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        args.model = args.models[0]
        return llama_worker(args)

    kernels = args.kernels.split(",")
    results = {}  # (model, engine) -> {"pp": [...], "tg": [...]}
    notes = {}
    for rnd in range(args.rounds):
        for model in args.models:
            for k in kernels:
                wait_quiet(args.wait_quiet)
                s, n = run_brigade(args, model, k)
                notes[(model, k)] = n
                r = results.setdefault((model, f"brigade {k}"), {"pp": [], "tg": []})
                r["pp"] += s["pp"]
                r["tg"] += s["tg"]
            # the other binary under each of the same kernel settings
            for k in kernels if args.baseline else []:
                wait_quiet(args.wait_quiet)
                s, _ = run_brigade(args, model, k, args.baseline)
                r = results.setdefault((model, f"baseline {k}"), {"pp": [], "tg": []})
                r["pp"] += s["pp"]
                r["tg"] += s["tg"]
            wait_quiet(args.wait_quiet)
            s = run_llama(args, model)
            r = results.setdefault((model, "llama.cpp"), {"pp": [], "tg": []})
            r["pp"] += s["pp"]
            r["tg"] += s["tg"]
            # each round's figures as they come, so that a run that fails later leaves them
            figures = "; ".join(f"{e} pp {mean(r['pp'][-args.reps:]):.1f} tg {mean(r['tg'][-args.reps:]):.1f}"
                                for (m, e), r in results.items() if m == model)
            print(f"round {rnd + 1}/{args.rounds}: {os.path.basename(model)}: {figures}", file=sys.stderr)

    print(f"CPU: {cpu_summary()}; {args.threads} threads; pp{args.n_prompt} / tg{args.n_gen}, "
          f"{args.reps} reps × {args.rounds} interleaved rounds; t/s means\n")
    print(f"| model | engine | pp{args.n_prompt} | tg{args.n_gen} | pp vs llama.cpp | tg vs llama.cpp |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model in args.models:
        ref = results[(model, "llama.cpp")]
        for engine in [f"brigade {k}" for k in kernels] + ([f"baseline {k}" for k in kernels] if args.baseline else []) + ["llama.cpp"]:
            r = results[(model, engine)]
            pp, tg = mean(r["pp"]), mean(r["tg"])
            rp = pp / mean(ref["pp"]) if ref["pp"] else float("nan")
            rt = tg / mean(ref["tg"]) if ref["tg"] else float("nan")
            print(f"| {os.path.basename(model)} | {engine} | {pp:.1f} | {tg:.1f} | {rp:.2f}× | {rt:.2f}× |")
    print()
    for (model, k), n in notes.items():
        for line in n:
            if line.startswith("CPU kernels"):
                print(f"- {os.path.basename(model)}, BRIGADE_CPU_KERNELS={k}: {line}")


if __name__ == "__main__":
    main()
