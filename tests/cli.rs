//! End-to-end tests of the `brigade` binary: the acceptance checks of the runtime issue, run as a
//! user would run them.

#![allow(clippy::unwrap_used)]

mod support;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use support::{root, smollm2};

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures").join(name)
}

/// Where the binary caches its measured figures: under the target dir, not the user's cache.
fn cache_home() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-cache")
}

/// The binary, with the environment variables `vars` set.
fn brigade_with(args: &[&str], vars: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_brigade"))
        .args(args)
        .envs(vars.iter().copied())
        .env("XDG_CACHE_HOME", cache_home())
        .output()
        .expect("running brigade")
}

fn brigade(args: &[&str]) -> Output {
    brigade_with(args, &[])
}

/// The JSON a successful run of `args` printed.
fn json_of(args: &[&str], out: Output) -> Value {
    assert!(out.status.success(), "brigade {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn ok_json(args: &[&str]) -> Value {
    json_of(args, brigade(args))
}

/// [`ok_json`] with the environment variables `vars` set.
fn json_with(args: &[&str], vars: &[(&str, &str)]) -> Value {
    json_of(args, brigade_with(args, vars))
}

/// A random-weight model of 2 layers, hidden 256, vocab 512 at `path`.
fn synth_small(path: &Path, ty: &str, seed: &str) {
    let p = path.to_str().unwrap();
    let out = brigade(&[
        "synth",
        "-o",
        p,
        "--type",
        ty,
        "--seed",
        seed,
        "--layers",
        "2",
        "--hidden",
        "256",
        "--ffn",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "512",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("greedy_llamacpp.json")).unwrap()).unwrap()
}

const KARPATHY: &str = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball. She wanted to play with it, but it was too high";

#[test]
fn run_matches_llama_cpp_greedy_on_all_three_stories_files() {
    let r = reference();
    let f32_path = root().join("crates/format/assets/stories260K.gguf");
    for (path, key, n_match) in [
        (f32_path, "stories260K.gguf", 60),
        (fixture("stories260K-Q8_0.gguf"), "stories260K-Q8_0.gguf", 60),
        (fixture("stories260K-Q4_0.gguf"), "stories260K-Q4_0.gguf", 27),
    ] {
        let j = ok_json(&["run", "-m", path.to_str().unwrap(), "-p", "", "-n", "60", "--temp", "0", "--json"]);
        let got = ids(&j["generated_ids"]);
        let want = ids(&r[key]["greedy_ids"]);
        assert_eq!(got.len(), 60);
        assert_eq!(got[..n_match], want[..n_match], "{key}");
        assert_eq!(ids(&j["prompt_ids"]), vec![1]);
        if n_match == 60 {
            assert_eq!(j["text"], KARPATHY, "{key}");
        }
        assert!(j["timings"]["generation_tokens_per_s"].as_f64().unwrap() > 0.0);
        let dev = &j["devices"][0];
        assert_eq!(dev["name"], "cpu");
        assert!(dev["bytes"].as_u64().unwrap() > 0);
    }
}

#[test]
fn embedded_model_is_the_default_and_streams_text() {
    let out = brigade(&["run", "-n", "60", "--temp", "0"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim_end(), KARPATHY);
    let err = String::from_utf8(out.stderr).unwrap();
    for want in ["load time", "prompt eval", "generation", "tokens/s", "device cpu", "KV cache"] {
        assert!(err.contains(want), "stderr lacks `{want}`: {err}");
    }
}

#[test]
fn device_map_splits_give_the_same_tokens() {
    let base = ok_json(&["run", "-n", "40", "--temp", "0", "--json"]);
    for map in ["cpu:1,cpu:4", "cpu:2,cpu:3", "cpu:4,cpu:1", "cpu:1,cpu:1,cpu:1,cpu:1,cpu:1"] {
        let j = ok_json(&["run", "-n", "40", "--temp", "0", "--json", "--device-map", map]);
        assert_eq!(j["generated_ids"], base["generated_ids"], "{map}");
        let stages = j["devices"].as_array().unwrap();
        assert_eq!(stages.len(), map.split(',').count());
        assert!(stages.iter().all(|d| d["bytes"].as_u64().unwrap() > 0));
    }
}

#[test]
fn sampling_is_seeded() {
    let a = ok_json(&["run", "-n", "30", "--temp", "1.0", "--seed", "7", "--json"]);
    let b = ok_json(&["run", "-n", "30", "--temp", "1.0", "--seed", "7", "--json"]);
    let c = ok_json(&["run", "-n", "30", "--temp", "1.0", "--seed", "8", "--json"]);
    assert_eq!(a["text"], b["text"]);
    assert_ne!(a["generated_ids"], c["generated_ids"]);
    assert_eq!(a["seed"], 7);
    let k1 = ok_json(&["run", "-n", "30", "--temp", "1.5", "--top-k", "1", "--seed", "3", "--json"]);
    let greedy = ok_json(&["run", "-n", "30", "--temp", "0", "--json"]);
    assert_eq!(k1["generated_ids"], greedy["generated_ids"], "top-k 1 is greedy");
}

#[test]
fn smollm2_greedy_and_chat() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let r = &reference()["SmolLM2-135M-Instruct.Q4_1.gguf"];
    let j = ok_json(&["run", "-m", m, "-p", "Once upon a time,", "-n", "25", "--temp", "0", "--json", "-c", "256"]);
    assert_eq!(j["prompt_ids"], r["prompt_ids"]);
    assert_eq!(j["generated_ids"], r["greedy_ids"]);
    assert_eq!(j["text"], r["text"]);
    let j = ok_json(&["run", "-m", m, "-p", "What is 2+2?", "-n", "8", "--temp", "0", "--chat", "--json", "-c", "256"]);
    let p = ids(&j["prompt_ids"]);
    // <|im_start|>system … <|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n
    assert_eq!(p[0], 1);
    assert_eq!(p.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(p.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(
        &p[p.len() - 3..],
        &[1, 520, 9531, 198][1..].iter().map(|&x| x as u64).collect::<Vec<_>>()[..],
        "ends with `assistant\\n`: {p:?}"
    );
    assert_eq!(p[p.len() - 4], 1);
    assert!(!j["text"].as_str().unwrap().is_empty());
}

/// `--spec-type ngram-simple` and `--model-draft` give `run` plain decoding's tokens (greedy and
/// seeded), report their drafts, and refuse what cannot draft.
#[test]
fn speculative_decoding_keeps_the_text_and_refuses_what_cannot_draft() {
    let stories = root().join("crates/format/assets/stories260K.gguf");
    let stories = stories.to_str().unwrap();
    for sampling in [&["--temp", "0"][..], &["--temp", "0.8", "--seed", "5"]] {
        let base = [&["run", "-p", "Once upon a time", "-n", "120", "--json"][..], sampling].concat();
        let plain = ok_json(&base);
        for spec in [&["--spec-type", "ngram-simple"][..], &["--model-draft", stories, "--spec-draft-n-max", "4"]] {
            let j = ok_json(&[&base[..], spec].concat());
            assert_eq!(j["generated_ids"], plain["generated_ids"], "{spec:?} {sampling:?}");
            let t = &j["timings"];
            assert!(t["drafted_tokens"].as_u64().unwrap() > 0, "{spec:?}: {t}");
            if spec[0] == "--model-draft" && sampling[1] == "0" {
                // the model as its own draft: every draft taken, fewer passes than tokens
                assert_eq!(t["drafted_tokens"], t["accepted_tokens"]);
                assert!(t["decode_passes"].as_u64().unwrap() * 2 < plain["timings"]["decode_passes"].as_u64().unwrap());
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other.gguf");
    synth_small(&other, "q8_0", "3");
    let other = other.to_str().unwrap();
    expect_error(&["run", "-n", "4", "--model-draft", other], "spells token 0");
    let wide = dir.path().join("wide.gguf");
    let w = wide.to_str().unwrap();
    let shape =
        ["--layers", "1", "--hidden", "64", "--ffn", "128", "--heads", "2", "--kv-heads", "1", "--vocab", "600"];
    let out = brigade(&[&["synth", "-o", w, "--type", "q8_0"][..], &shape].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    expect_error(&["run", "-n", "4", "--model-draft", w], "has 600 tokens, the model 512");
    expect_error(&["run", "-n", "4", "--spec-type", "ngram-simple", "--spec-draft-n-max", "0"], "--spec-draft-n-max 0");
    expect_error(&["run", "-n", "4", "--spec-type", "ngram-simple", "--model-draft", stories], "one source of drafts");
    expect_error(&["run", "-n", "4", "--model-draft", "/nonexistent/draft.gguf"], "cannot load draft model");
}

#[test]
fn chat_without_template_is_a_clear_error() {
    let out = brigade(&["run", "--chat", "-p", "hi", "-n", "4"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no chat template"));
}

fn expect_error(args: &[&str], needle: &str) {
    let out = brigade(args);
    assert_eq!(out.status.code(), Some(1), "brigade {args:?} should fail with exit 1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(needle), "brigade {args:?}: stderr lacks `{needle}`: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.gguf");
    std::fs::write(&text, "hello, I am not a model").unwrap();
    expect_error(&["run", "-m", text.to_str().unwrap()], "not a GGUF file");
    let full = std::fs::read(root().join("crates/format/assets/stories260K.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &full[..full.len() / 3]).unwrap();
    expect_error(&["run", "-m", cut.to_str().unwrap()], "past the end of the file");
    let mut bad = full.clone();
    bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let p = dir.path().join("absurd.gguf");
    std::fs::write(&p, &bad).unwrap();
    expect_error(&["run", "-m", p.to_str().unwrap()], "claims");
    expect_error(&["run", "-m", "/nonexistent/model.gguf"], "No such file");
    expect_error(&["run", "-ngl", "4"], "without CUDA");
    expect_error(&["run", "--device-map", "cpu:2,cpu:2"], "places 4 layers but the model has 5");
    expect_error(&["run", "--device-map", "tpu:5"], "unknown device");
    let out = brigade(&["run", "-ngl", "auto", "-n", "3"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-ngl auto"));
    // usage errors are exit 2 (clap), naming the value
    let out = brigade(&["run", "-n", "lots"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'lots'"));
    expect_error(&["run", "-n", "-2"], "-n -2: a token count, or -1 for no limit");
    let out = brigade(&["run", "-t", "5000", "-n", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("-t 5000: at most 1024 threads"));
}

#[test]
fn llama_cpp_flags_mean_what_they_mean_there() {
    // -c 0 is the model's trained context (the embedded model says 2048), -n -1 runs to its end
    let j = ok_json(&["run", "-c", "0", "-n", "-1", "--temp", "0", "--json"]);
    assert_eq!(j["n_ctx"], 2048);
    assert_eq!(j["stop"], "context");
    // the prompt's one token and 2047 generated ones fill the context; the 2048th is sampled, unfed
    assert_eq!(ids(&j["generated_ids"]).len(), 2048);
    // -n -1 stops at an end of text when there is one
    let j = ok_json(&["run", "-c", "0", "-n", "-1", "--temp", "0", "--json", "-p", "Once upon a time"]);
    assert!(["eos", "context"].contains(&j["stop"].as_str().unwrap()), "{}", j["stop"]);
    // -t is read per subcommand: 0 is every logical CPU, and -ngl belongs to run and bench only
    assert!(brigade(&["run", "-t", "0", "-n", "2"]).status.success());
    let out = brigade(&["plan", "-ngl", "3", "--shape", "llama-1b", "--quant", "q4_k"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unexpected argument '-n'"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = brigade(&["plan", "-t", "2", "--shape", "llama-1b", "--quant", "q4_k"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn synth_gguf_and_safetensors_give_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let g = dir.path().join("m.gguf");
    let h = dir.path().join("m-hf");
    let shape =
        ["--layers", "3", "--hidden", "128", "--ffn", "256", "--heads", "4", "--kv-heads", "2", "--vocab", "512"];
    let mut a = vec!["synth", "-o", g.to_str().unwrap(), "--type", "f32", "--seed", "9"];
    a.extend(shape);
    assert!(brigade(&a).status.success());
    let mut a = vec!["synth", "-o", h.to_str().unwrap(), "--type", "f32", "--seed", "9", "--format", "safetensors"];
    a.extend(shape);
    assert!(brigade(&a).status.success());
    assert!(
        h.join("model.safetensors").exists() && h.join("tokenizer.json").exists() && h.join("config.json").exists()
    );
    let run = |m: &Path, map: &str| {
        ok_json(&[
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "hello world",
            "-n",
            "16",
            "--temp",
            "0",
            "--json",
            "--device-map",
            map,
        ])
    };
    let x = run(&g, "cpu:3");
    let y = run(&h, "cpu:1,cpu:2");
    assert_eq!(x["prompt_ids"], y["prompt_ids"]);
    assert_eq!(x["generated_ids"], y["generated_ids"]);
    // --chat works on synthetic models (ChatML template)
    let c = ok_json(&["run", "-m", g.to_str().unwrap(), "-p", "hi", "-n", "2", "--temp", "0", "--chat", "--json"]);
    assert!(ids(&c["prompt_ids"]).len() > 5);
    // presets have the real shapes
    let p = dir.path().join("p.gguf");
    let out = brigade(&[
        "synth",
        "-o",
        p.to_str().unwrap(),
        "--preset",
        "llama-1b",
        "--layers",
        "1",
        "--vocab",
        "1000",
        "--type",
        "q4_k",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["shape"]["hidden"], 2048);
    assert_eq!(j["shape"]["ffn"], 8192);
    assert_eq!(j["shape"]["kv_heads"], 8);
    let j = ok_json(&["run", "-m", p.to_str().unwrap(), "-p", "a", "-n", "3", "--temp", "0", "--json", "-c", "64"]);
    assert_eq!(ids(&j["generated_ids"]).len(), 3);
}

#[test]
fn bench_reports_rows_bandwidth_and_bound() {
    let out = brigade(&["bench", "-p", "16", "-n", "8", "-r", "2", "-o", "json", "--measure", "quick"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["test"], "pp16");
    assert_eq!(rows[1]["test"], "tg8");
    for r in rows {
        assert_eq!(r["samples_ts"].as_array().unwrap().len(), 2);
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
        assert!(r["devices"][0]["bytes"].as_u64().unwrap() > 0);
    }
    assert!(j["bandwidth"][0]["bytes_per_s"].as_f64().unwrap() > 1e8);
    let f = rows[1]["fraction_of_bound"].as_f64().unwrap();
    assert!(f > 0.0 && f < 1.5, "fraction of bound {f}");
    // the cost model's prediction beside each measurement, from this machine's figures
    for r in rows {
        let p = r["predicted_ts"].as_f64().unwrap();
        assert!(p.is_finite() && p > 0.0, "{r}");
    }
    let md = brigade(&["bench", "-p", "8", "-n", "4", "-r", "1", "--no-bandwidth", "--measure", "quick"]);
    let md = String::from_utf8(md.stdout).unwrap();
    assert!(md.contains("| pp8 |") && md.contains("| tg4 |"), "{md}");
    // the embedded model's layer matrices are f32: the report names their kernels
    let kernels: Vec<&str> = md.lines().filter(|l| l.starts_with("note: CPU kernels for ")).collect();
    assert!(!kernels.is_empty() && kernels.iter().all(|l| l.contains("decode ") && l.contains(", prompt ")), "{md}");
    assert!(md.contains("| predicted t/s |") && md.contains("the cost model predicted"), "{md}");
    let csv = brigade(&["bench", "-p", "8", "-n", "0", "-r", "1", "-o", "csv", "--no-bandwidth", "--measure", "quick"]);
    assert_eq!(String::from_utf8(csv.stdout).unwrap().lines().count(), 2);
}

/// `-d` (llama-bench's depth) runs every test after that many tokens, untimed; the cost model's
/// prediction and the bandwidth bound count no cache, so a deep row has neither; the flag is
/// refused where no model file is benchmarked here.
#[test]
fn bench_runs_every_test_at_every_depth() {
    let j = ok_json(&["bench", "-p", "8", "-n", "4", "-d", "0,40", "-r", "1", "-o", "json", "--measure", "quick"]);
    let rows = j["rows"].as_array().unwrap();
    let tests: Vec<(&str, u64)> =
        rows.iter().map(|r| (r["test"].as_str().unwrap(), r["n_depth"].as_u64().unwrap())).collect();
    assert_eq!(tests, [("pp8", 0), ("tg4", 0), ("pp8 @ d40", 40), ("tg4 @ d40", 40)]);
    for r in rows {
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0, "{r}");
        let deep = r["n_depth"].as_u64().unwrap() > 0;
        assert_eq!(r["predicted_ts"].is_null(), deep, "{r}");
    }
    assert!(rows[1]["bound_ts"].as_f64().is_some() && rows[3]["bound_ts"].is_null());
    let out = brigade(&["bench", "--url", "http://127.0.0.1:9", "-d", "16"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-d (context depth)"));
}

#[test]
fn bench_sweeps_thread_counts_in_child_processes() {
    // (`--no-warmup` is handed to each child too: a child that refused it would fail the run)
    let j = ok_json(&[
        "bench",
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "1",
        "-t",
        "1,2",
        "-o",
        "json",
        "--measure",
        "quick",
        "--no-warmup",
    ]);
    let rows = j["rows"].as_array().unwrap();
    let threads: Vec<u64> = rows.iter().map(|r| r["threads"].as_u64().unwrap()).collect();
    assert_eq!(threads, [1, 1, 2, 2]);
    let bw: Vec<u64> = j["bandwidth"].as_array().unwrap().iter().map(|b| b["threads"].as_u64().unwrap()).collect();
    assert_eq!(bw, [1, 2]);
    // one -t is this process's own count
    let j = ok_json(&[
        "bench",
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "1",
        "-o",
        "json",
        "--no-bandwidth",
        "--measure",
        "quick",
    ]);
    assert_eq!(j["rows"][0]["threads"], 1);
}

#[test]
fn bench_concurrency_prompts_of_words_or_token_ids() {
    // `brigade serve` on the embedded model (vocabulary 512), measured through its API
    let common = ["bench", "--concurrency", "1,2", "-n", "4", "-r", "1", "-t", "1", "-o", "json"];
    let j = ok_json(&[&common[..], &["--prompt-tokens", "12"]].concat());
    let rows = j.as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["concurrency"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
    for r in rows {
        assert_eq!(r["prompt_tokens_avg"], 12.0, "{r}");
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0, "{r}");
    }
    // words: as many tokens as the server's tokenizer makes of them (more than one per word here)
    let j = ok_json(&[&common[..], &["--prompt-words", "5"]].concat());
    let n = j[0]["prompt_tokens_avg"].as_f64().unwrap();
    assert!(n > 6.0, "{j}");
    // the table says how long the prompts were
    let out = brigade(&["bench", "--concurrency", "2", "-n", "2", "-r", "1", "-t", "1", "--prompt-tokens", "7"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("each client's prompt: 7 token ids, 7 tokens"), "{text}");
    // the flag serves the model even for one client
    let j = ok_json(&["bench", "-n", "2", "-r", "1", "-t", "1", "-o", "json", "--prompt-tokens", "5"]);
    assert_eq!(j[0]["prompt_tokens_avg"], 5.0, "{j}");
    // one or the other
    let out = brigade(&["bench", "--concurrency", "2", "--prompt-tokens", "7", "--prompt-words", "3"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"), "{out:?}");
}

#[test]
fn doctor_describes_this_machine() {
    let j = ok_json(&["doctor", "--json", "-t", "1"]);
    assert_eq!(j["brigade"]["version"], env!("CARGO_PKG_VERSION"));
    let cpu = &j["cpu"];
    assert!(!cpu["model"].as_str().unwrap().is_empty());
    let logical = cpu["logical_cpus"].as_u64().unwrap();
    assert!(logical >= 1 && cpu["default_threads"].as_u64().unwrap() <= logical);
    if cfg!(target_arch = "x86_64") {
        let sets: Vec<&str> = cpu["instruction_sets"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
        assert!(sets.contains(&"sse4.2"), "{sets:?}");
    }
    // a kernel for each weight type, Q4_K and Q8_0 among them
    let kernels = j["kernels"]["weights"].as_array().unwrap();
    for t in ["f32", "q8_0", "q4_k", "q6_k"] {
        let k = kernels.iter().find(|k| k["weight_type"] == t).unwrap_or_else(|| panic!("{t}: {kernels:?}"));
        assert!(!k["decode"].as_str().unwrap().is_empty() && !k["prompt"].as_str().unwrap().is_empty());
    }
    let loops = j["kernels"]["vector_loops"].as_str().unwrap();
    assert!(["avx512", "avx2", "scalar"].contains(&loops), "{loops}");
    // BRIGADE_CPU_KERNELS=portable holds for the matmuls and the vector loops alike
    let p = json_with(&["doctor", "--json", "-t", "1"], &[("BRIGADE_CPU_KERNELS", "portable")]);
    assert_eq!(p["kernels"]["asked"], "portable");
    assert_eq!(p["kernels"]["vector_loops"], "scalar");
    let q4k = p["kernels"]["weights"].as_array().unwrap().iter().find(|k| k["weight_type"] == "q4_k").unwrap();
    assert!(!q4k["decode"].as_str().unwrap().contains("brigade"), "{q4k}");
    let m = &j["memory"];
    assert!(m["available_bytes"].as_u64().unwrap() <= m["total_bytes"].as_u64().unwrap());
    assert!(m["total_bytes"].as_u64().unwrap() > 1 << 28);
    let bw = &j["bandwidth"];
    let read = bw["read_bytes_per_s"].as_f64().unwrap();
    assert!(read > 1e8 && read < 1e13, "{bw}");
    assert_eq!(bw["threads"], 1);
    assert!(bw["buffer_bytes"].as_u64().unwrap() >= 256 << 20);
    let libs = j["cuda_libraries"].as_array().unwrap();
    assert!(libs.iter().any(|l| l["name"] == "libcuda.so.1"));
    for l in libs {
        assert!(!l["why"].as_str().unwrap().is_empty(), "{l}");
    }
    if !cfg!(feature = "cuda") {
        assert!(j["gpus"].as_array().unwrap().is_empty());
        assert!(j["notes"][0].as_str().unwrap().contains("no CUDA"));
    }
    let text = String::from_utf8(brigade(&["doctor", "-t", "1"]).stdout).unwrap();
    for want in [
        "brigade ",
        "instruction sets:",
        "kernels (decode / prompt):",
        "vector loops",
        "read bandwidth:",
        "cuda libraries",
    ] {
        assert!(text.contains(want), "`{want}` missing:\n{text}");
    }
}

fn clusters() -> PathBuf {
    root().join("examples/clusters")
}

#[test]
fn plan_prints_text_json_and_svg() {
    let c = clusters().join("single-box.toml");
    let out = brigade(&["plan", "--shape", "llama-70b", "--quant", "q4_k", "--cluster", c.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for want in [
        "box/cuda0",
        "box/cpu",
        "decode:",
        "prefill: 512 tokens",
        "bottleneck:",
        "why:",
        "rejected:",
        "does not fit by",
    ] {
        assert!(text.contains(want), "`{want}` missing:\n{text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("plan.svg");
    let j = ok_json(&[
        "plan",
        "--shape",
        "llama-8b",
        "--quant",
        "q4_k",
        "--cluster",
        c.to_str().unwrap(),
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    for key in [
        "objective",
        "stages",
        "hops",
        "decode_ms_per_token",
        "tokens_per_s",
        "prefill_ms_512",
        "bottleneck",
        "rejected",
    ] {
        assert!(j.get(key).is_some(), "{key} missing in {j}");
    }
    let st = &j["stages"][0];
    for key in ["node", "device", "layers", "weight_bytes", "kv_bytes", "memory_bytes", "budget_bytes", "compute_ms"] {
        assert!(st.get(key).is_some(), "{key} missing in {st}");
    }
    assert_eq!(st["layers"], serde_json::json!([0, 32]));
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.contains("box/cuda0"));
    // from a model file's header
    let m = fixture("stories260K-Q8_0.gguf");
    let j = ok_json(&["plan", "-m", m.to_str().unwrap(), "--cluster", c.to_str().unwrap(), "--json"]);
    assert_eq!(j["stages"][0]["layers"], serde_json::json!([0, 5]));
    // a second model kept on the GPU
    let j = ok_json(&[
        "plan",
        "--shape",
        "llama-70b",
        "--quant",
        "q4_k",
        "--also-shape",
        "llama-1b",
        "--also-quant",
        "q8_0",
        "--cluster",
        c.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(j["also_plan"]["stages"][0]["device"], "cuda0");
    assert_eq!(j["reserved"][0]["device"], "cuda0");
}

#[test]
fn plan_for_this_box_uses_its_measured_figures() {
    let m = fixture("stories260K-Q8_0.gguf");
    let j = ok_json(&["plan", "-m", m.to_str().unwrap(), "--json", "--measure", "quick", "--ctx", "256"]);
    let st = &j["stages"][0];
    assert_eq!(st["node"], "local");
    assert_eq!(st["layers"], serde_json::json!([0, 5]));
    // the CPU keeps its KV cache in f32: 5 layers × 256 tokens × 2 × (4 kv heads × 8) × 4 bytes
    assert_eq!(st["kv_bytes"], 5 * 256 * 2 * 32 * 4);
    assert!(j["tokens_per_s"].as_f64().unwrap() > 0.0);
    // --kv-type overrides it
    let j = ok_json(&[
        "plan",
        "-m",
        m.to_str().unwrap(),
        "--json",
        "--measure",
        "quick",
        "--ctx",
        "256",
        "--kv-type",
        "f16",
    ]);
    assert_eq!(j["stages"][0]["kv_bytes"], 5 * 256 * 2 * 32 * 2);
}

#[test]
fn plan_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(clusters().join("gateway-edges.toml")).unwrap();
    let cases = [
        (good.replace("\"24 GiB\"", "\"24 gigs\""), "24 gigs"),
        (good.replacen("\"1 Gbit/s\"", "\"-1 Gbit/s\"", 1), "must be positive"),
        (good.replacen("\"1 Gbit/s\"", "\"0 Gbit/s\"", 1), "must be positive"),
        (good.replace("name = \"edge-3\"", "name = \"edge-2\""), "appears twice"),
        (good.replacen("b = \"edge-1\"", "b = \"edge-7\"", 1), "unknown node `edge-7`"),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let p = dir.path().join(format!("c{i}.toml"));
        std::fs::write(&p, text).unwrap();
        expect_error(&["plan", "--shape", "llama-8b", "--quant", "q4_k", "--cluster", p.to_str().unwrap()], needle);
    }
    let c = clusters().join("gateway-edges.toml");
    let notes = dir.path().join("notes.gguf");
    std::fs::write(&notes, "not a model").unwrap();
    expect_error(&["plan", "-m", notes.to_str().unwrap(), "--cluster", c.to_str().unwrap()], "not a GGUF file");
    expect_error(
        &["plan", "--shape", "llama-9b", "--quant", "q4_k", "--cluster", c.to_str().unwrap()],
        "unknown shape",
    );
    expect_error(
        &["plan", "--shape", "llama-8b", "--quant", "q4_k", "--cluster", c.to_str().unwrap(), "--driver", "moon"],
        "driver node `moon`",
    );
    // infeasible: nonzero exit, JSON error with the shortfall
    let out = brigade(&[
        "plan",
        "--shape",
        "llama-70b",
        "--quant",
        "f16",
        "--cluster",
        clusters().join("small-vram.toml").to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(j["error"].as_str().unwrap().contains("does not fit"));
    assert!(j["shortfall_bytes"].as_u64().unwrap() > 100 << 30);
}

/// `brigade` on a CPU without AVX-512, whatever CPU runs the tests: valgrind's `none` tool (no
/// checking, ~30× slower) runs the binary on valgrind's own x86 model, which has AVX2, FMA and
/// F16C where the host has them and never any AVX-512 (valgrind decodes no AVX-512 instruction:
/// one would stop the run with SIGILL). What an AVX2-only machine (an AMD EPYC before Zen 4, a
/// desktop Intel) takes: the kernels chosen at run time by CPUID, not by `BRIGADE_CPU_KERNELS`.
fn on_avx2_cpu(args: &[&str]) -> Value {
    let out = Command::new("valgrind")
        .args(["--tool=none", "-q", "--error-exitcode=9", env!("CARGO_BIN_EXE_brigade")])
        .args(args)
        .env("XDG_CACHE_HOME", cache_home())
        .env_remove("BRIGADE_CPU_KERNELS")
        .output()
        .expect("running valgrind (.ci/run installs it: Debian's valgrind)");
    json_of(args, out)
}

#[cfg(target_arch = "x86_64")]
#[test]
fn on_a_cpu_without_avx512_the_avx2_kernels_run_and_give_the_same_tokens() {
    // what brigade sees: no AVX-512, and AVX2 kernels for every type it has its own kernels for
    let j = on_avx2_cpu(&["doctor", "--json", "-t", "1"]);
    let sets: Vec<&str> =
        j["cpu"]["instruction_sets"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    assert!(sets.contains(&"avx2") && sets.contains(&"fma") && sets.contains(&"f16c"), "{sets:?}");
    assert!(!sets.iter().any(|s| s.starts_with("avx512")), "{sets:?}");
    assert_eq!(j["kernels"]["asked"], "");
    assert_eq!(j["kernels"]["vector_loops"], "avx2");
    let kernels = j["kernels"]["weights"].as_array().unwrap();
    for t in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"] {
        let k = kernels.iter().find(|k| k["weight_type"] == t).unwrap_or_else(|| panic!("{t}: {kernels:?}"));
        for path in ["decode", "prompt"] {
            let name = k[path].as_str().unwrap();
            assert!(name.starts_with("brigade AVX2 int8"), "{t} {path}: {name}");
        }
    }

    // llama.cpp's greedy tokens, as on the host's own kernels (Q8_0 and Q4_0 decode)
    let r = reference();
    for (key, n_match) in [("stories260K-Q8_0.gguf", 60), ("stories260K-Q4_0.gguf", 27)] {
        let path = fixture(key);
        let j = on_avx2_cpu(&["run", "-m", path.to_str().unwrap(), "-p", "", "-n", "60", "--temp", "0", "--json"]);
        assert_eq!(ids(&j["generated_ids"])[..n_match], ids(&r[key]["greedy_ids"])[..n_match], "{key}");
    }

    // K-quants (packed Q4_K, Q6_K) and Q4_0, prompts long enough for the int8 tiles: the tokens
    // of the host's AVX2 kernels forced by BRIGADE_CPU_KERNELS (the same code, so the same bits)
    let dir = tempfile::tempdir().unwrap();
    let prompt = "The quick brown fox jumps over the lazy dog and then runs far away into the forest";
    for ty in ["q4_k", "q6_k", "q4_0"] {
        let m = dir.path().join(format!("{ty}.gguf"));
        synth_small(&m, ty, "3");
        let args = ["run", "-m", m.to_str().unwrap(), "-p", prompt, "-n", "24", "--temp", "0", "--json"];
        let got = on_avx2_cpu(&args);
        let want = json_with(&args, &[("BRIGADE_CPU_KERNELS", "avx2")]);
        assert!(ids(&got["prompt_ids"]).len() > 32, "{ty}: the prompt must take the tiles");
        assert_eq!(got["prompt_ids"], want["prompt_ids"], "{ty}");
        assert_eq!(ids(&got["generated_ids"]).len(), 24, "{ty}");
        assert_eq!(got["generated_ids"], want["generated_ids"], "{ty}");
    }
}

/// The vec-dots are compiled once for the default prefetch and once for the others
/// (`BRIGADE_CPU_PREFETCH=off|near`, read per block): every mode gives the same tokens, for the
/// 32-weight loop (Q4_0) and the super-block one (Q6_K, a vec-dot on AVX2), and on the instruction
/// set the CPU has (Q4_0 decode is a vec-dot on every one).
#[test]
fn prefetch_modes_give_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let q6k = dir.path().join("q6_k.gguf");
    synth_small(&q6k, "q6_k", "5");
    let q4_0 = fixture("stories260K-Q4_0.gguf");
    for (model, kernels) in [(q4_0.to_str().unwrap(), "auto"), (q6k.to_str().unwrap(), "avx2")] {
        let args = ["run", "-m", model, "-p", "Once upon a time", "-n", "24", "--temp", "0", "--json"];
        let want = json_with(&args, &[("BRIGADE_CPU_KERNELS", kernels)]);
        assert_eq!(ids(&want["generated_ids"]).len(), 24);
        for mode in ["off", "near"] {
            let got = json_with(&args, &[("BRIGADE_CPU_KERNELS", kernels), ("BRIGADE_CPU_PREFETCH", mode)]);
            assert_eq!(got["generated_ids"], want["generated_ids"], "{model} BRIGADE_CPU_PREFETCH={mode}");
        }
    }
}

/// Split layers (llama.cpp's `--cpu-moe` / `--n-cpu-moe N`) on a random-weight mixture: the
/// same greedy ids as whole layers, each stage's experts in RAM as predicted; `bench` rows per
/// split; `plan` searching the split on a one-box cluster, in text, JSON and SVG; a dense model
/// refuses the flags.
#[test]
fn split_layers_keep_the_tokens_and_show_in_plan_and_bench() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("moe.gguf");
    let mp = m.to_str().unwrap();
    let shape = "--type q4_k --seed 5 --layers 4 --hidden 256 --ffn 256 --heads 4 --kv-heads 2 --vocab 512 \
                 --experts 8 --experts-used 2 --moe-family qwen3moe";
    let out = brigade(&[&["synth", "-o", mp][..], &shape.split_whitespace().collect::<Vec<_>>()].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "-m", mp, "-p", "Once upon a time", "-n", "24", "--temp", "0", "--json"];
        a.extend_from_slice(extra);
        ok_json(&a)
    };
    let whole = run(&[]);
    let want = ids(&whole["generated_ids"]);
    assert_eq!(whole["n_cpu_moe"], 0);
    assert_eq!(want.len(), 24);
    for extra in [&["--n-cpu-moe", "2"][..], &["--cpu-moe"], &["--cpu-moe", "--device-map", "cpu:1,cpu:3"]] {
        let j = run(extra);
        assert_eq!(ids(&j["generated_ids"]), want, "{extra:?}");
        assert_eq!(j["n_cpu_moe"], if extra[0] == "--n-cpu-moe" { 2 } else { 4 }, "{extra:?}");
        for d in j["devices"].as_array().unwrap() {
            let (held, predicted) =
                (d["host_expert_bytes"].as_u64().unwrap(), d["predicted_host_expert_bytes"].as_u64().unwrap());
            assert_eq!(held, predicted, "{extra:?}: {d}");
            assert!(held > 0, "{extra:?}: {d}");
        }
    }
    expect_error(&["run", "-n", "2", "--n-cpu-moe", "1"], "no experts");
    // bench: a row set per split, the split in the table
    let bench = "bench -p 16 -n 4 -r 1 -o json --no-bandwidth --measure quick --n-cpu-moe 0,2,all";
    let words = |s: &'static str| s.split_whitespace().collect::<Vec<&str>>();
    let j = ok_json(&[&words(bench)[..], &["-m", mp]].concat());
    let splits: Vec<u64> = j["rows"].as_array().unwrap().iter().map(|r| r["n_cpu_moe"].as_u64().unwrap()).collect();
    assert_eq!(splits, [0, 0, 2, 2, 4, 4]);
    let md = brigade(
        &[&words("bench -p 0 -n 4 -r 1 --no-bandwidth --measure quick --n-cpu-moe 3")[..], &["-m", mp]].concat(),
    );
    let md = String::from_utf8(md.stdout).unwrap();
    assert!(md.contains("n-cpu-moe 3 | tg4 |") && md.contains(" in RAM |"), "{md}");
    // plan: Qwen3-30B-A3B at Q8_0 (32 GB) on a 24 GB GPU and 64 GB of RAM
    let c = clusters().join("single-box.toml");
    let svg = dir.path().join("moe.svg");
    let args = [
        "plan",
        "--shape",
        "qwen3-30b-a3b",
        "--quant",
        "q8_0",
        "--cluster",
        c.to_str().unwrap(),
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ];
    let j = ok_json(&args);
    let n = j["cpu_moe"].as_u64().unwrap();
    assert!(n > 0 && n < 48, "{j}");
    let gpu = j["stages"].as_array().unwrap().iter().find(|s| s["device"] == "cuda0").unwrap();
    assert_eq!(gpu["host_layers"][1].as_u64(), Some(n), "{gpu}");
    assert!(gpu["host_expert_bytes"].as_u64().unwrap() > 0);
    assert_eq!(j["host_device"], "box/cpu");
    let whole = j["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["alternative"].as_str().unwrap().starts_with("whole layers"));
    let whole_rate = whole.and_then(|r| r["tokens_per_s"].as_f64()).unwrap();
    assert!(j["tokens_per_s"].as_f64().unwrap() > whole_rate, "{j}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("in RAM"));
    let text = String::from_utf8(brigade(&args[..7]).stdout).unwrap();
    assert!(text.contains(&format!("split layers (--n-cpu-moe {n})")), "{text}");
    // a fixed split, every layer
    let j = ok_json(&[&args[..8], &["--cpu-moe"][..]].concat());
    assert_eq!(j["cpu_moe"], 48);
    // a dense shape refuses a split
    expect_error(
        &["plan", "--shape", "llama-8b", "--quant", "q4_k", "--cluster", c.to_str().unwrap(), "--n-cpu-moe", "4"],
        "has no experts",
    );
    // across nodes each node's RAM holds its own layers' experts (two boxes: the exact program)
    let two = clusters().join("two-gpu-boxes.toml");
    let args = ["plan", "--shape", "qwen3-235b-a22b", "--quant", "q4_k", "--cluster", two.to_str().unwrap()];
    let j = ok_json(&[&args[..], &["--cpu-moe", "--json"][..]].concat());
    assert_eq!(j["exact"], true, "{j}");
    assert!(j["heuristic"].is_null(), "{j}");
    for st in j["stages"].as_array().unwrap() {
        let (node, cpu) = (st["node"].as_str().unwrap(), st["device"] == "cpu");
        assert_eq!(st["host_layers"].is_null(), cpu, "{st}");
        if !cpu {
            assert_eq!(st["host_device"], format!("{node}/cpu"), "{st}");
        }
    }
    // not asked: every split searched, the best kept against whole layers
    let j = ok_json(&[&args[..], &["--json"][..]].concat());
    let n = j["cpu_moe"].as_u64().unwrap();
    assert!(n > 0 && n < 94, "{j}");
    let whole =
        j["rejected"].as_array().unwrap().iter().find(|r| r["alternative"].as_str().unwrap().starts_with("whole"));
    let whole_rate = whole.and_then(|r| r["tokens_per_s"].as_f64()).unwrap();
    assert!(j["tokens_per_s"].as_f64().unwrap() > whole_rate, "{j}");
}
