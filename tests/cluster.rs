//! Cluster mode end to end: a coordinator and workers as separate processes of the built binary,
//! over loopback sockets with TLS. Greedy output must equal `brigade run` in one process, token id
//! for token id.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;
use support::*;

/// Stories prompts of different lengths.
const PROMPTS: [&str; 4] = ["Once upon a time", "The cat", "Lily went to the park and saw a big dog", "One day"];

fn stage_fetched(dep: &serde_json::Value) -> Vec<u64> {
    dep["stages"].as_array().unwrap().iter().map(|s| s["fetched_bytes"].as_u64().unwrap()).collect()
}

#[test]
fn three_workers_generate_what_run_generates_with_sixteen_clients_at_once() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    for w in ["w1", "w2", "w3"] {
        c.start_worker(w, &[]);
    }
    c.wait_up(3);
    let synth_path = c.path("small.gguf");
    synth_shape(&synth_path, [6, 256, 512, 8, 4, 512], "q8_0");
    let d = c.deploy(&["--name", "stories", "--device-map", "w1:cpu:2,w2:cpu:2,w3:cpu:1"]);
    assert_eq!(d["state"], "ready");
    assert_eq!(d["stages"].as_array().unwrap().len(), 3);
    // the embedded model is in every binary: nothing is fetched
    assert_eq!(stage_fetched(&d), vec![0, 0, 0]);
    let s = c.deploy(&[
        "--name",
        "small",
        "-m",
        synth_path.to_str().unwrap(),
        "--device-map",
        "w1:cpu:2,w2:cpu:2,w3:cpu:2",
    ]);
    // the workers had no copy of the file: each fetched about its own third, never the whole file
    let size = std::fs::metadata(&synth_path).unwrap().len();
    for (i, f) in stage_fetched(&s).into_iter().enumerate() {
        let weights = s["stages"][i]["weight_bytes"].as_u64().unwrap();
        assert!(f > 0 && f < size * 3 / 5, "stage {i} fetched {f} of a {size}-byte file");
        assert!(f + 64 * 1024 >= weights, "stage {i} fetched {f} bytes for {weights} bytes of weights");
    }
    // Qwen3 (q/k norms), Phi-3 (fused projections) and Gemma 3 (post-norms, local windows)
    // quantized by llama.cpp, cut over the three workers: the workers fetch their slices and
    // answer what `run` answers (which equals llama.cpp's ids, crates/model/tests/families.rs)
    let families = [
        ("qwen3", "w2:cpu:1,w3:cpu:1,w1:cpu:1"),
        ("phi3", "w1:cpu:1,w2:cpu:1,w3:cpu:1"),
        ("gemma3", "w3:cpu:2,w1:cpu:3,w2:cpu:1"),
    ];
    let family_file = |f: &str| root().join(format!("tests/fixtures/families/{f}/{f}-tiny-Q4_K_M.gguf"));
    for (f, map) in families {
        let d = c.deploy(&["--name", f, "-m", family_file(f).to_str().unwrap(), "--device-map", map]);
        assert_eq!(d["stages"].as_array().unwrap().len(), 3, "{f}: {d}");
        assert!(stage_fetched(&d).iter().all(|b| *b > 0), "{f}: {d}");
    }
    // a real checkpoint, Gemma 3 270M, six layers a worker: a prompt of 776 tokens across its
    // 512-token window, read in `run`'s chunks of 512 (in chunks of 64, the default over several
    // stages, a prompt row's numbers are the same where all its weight types are packed — on
    // AVX-512 — but not where some are read in the file's layout, whose prompt kernels round
    // unlike the decode kernels: Q6_K and Q8_0 on AVX2; on this prompt a near tie at the 12th
    // token, 0.11 apart in logits, then goes the other way)
    let gemma3_270m = gemma3_270m();
    let m = gemma3_270m.to_str().unwrap();
    c.deploy(&["--name", "gemma3-270m", "-m", m, "--device-map", "w2:cpu:6,w3:cpu:6,w1:cpu:6", "--ubatch", "512"]);
    let lighthouse = std::fs::read_to_string(root().join("tests/fixtures/prompts/lighthouse.txt")).unwrap();
    let (prompt_ids, want) = run_ids(Some(&gemma3_270m), &lighthouse, 24);
    let got = c.generate("gemma3-270m", &lighthouse, 24);
    assert_eq!((ids(&got["prompt_ids"]), ids(&got["generated_ids"])), (prompt_ids, want), "gemma3-270m");
    // the same order over gRPC instead of QUIC, in another order of nodes
    c.deploy(&["--name", "stories-grpc", "--transport", "grpc", "--device-map", "w3:cpu:2,w1:cpu:2,w2:cpu:1"]);

    for p in PROMPTS {
        let (prompt_ids, want) = run_ids(None, p, 24);
        for model in ["stories", "stories-grpc"] {
            let got = c.generate(model, p, 24);
            assert_eq!(ids(&got["prompt_ids"]), prompt_ids, "{model}: {p}");
            assert_eq!(ids(&got["generated_ids"]), want, "{model}: {p}\n{}", c.logs());
            let hops = got["hops"].as_array().unwrap();
            assert_eq!(hops.len(), 3, "per stage compute and per hop transfer: {got}");
            assert!(hops.iter().all(|h| h["compute_ms_per_token"].as_f64().unwrap() > 0.0));
        }
        for (f, _) in families {
            let (_, want) = run_ids(Some(&family_file(f)), p, 32);
            assert_eq!(ids(&c.generate(f, p, 32)["generated_ids"]), want, "{f}: {p}");
        }
        let (_, want) = run_ids(Some(&synth_path), p, 16);
        assert_eq!(ids(&c.generate("small", p, 16)["generated_ids"]), want, "small: {p}");
    }
    // a JSON schema through `brigade generate` (the Rust SDK, gRPC `Generate`): the last of three
    // stages draws only what the schema allows, over QUIC and over gRPC, at temperature 1.2
    let schema = r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
        "w": {"enum": ["yes", "no"]}}, "required": ["n", "w"], "additionalProperties": false}"#;
    for (model, seed) in [("stories-grpc", "1"), ("gemma3", "2"), ("stories", "3")] {
        let out = c.brigade(&[
            "generate",
            "--model",
            model,
            "-p",
            "Once",
            "-n",
            "64",
            "--temp",
            "1.2",
            "-s",
            seed,
            "--json-schema",
            schema,
            "--json",
        ]);
        assert!(out.status.success(), "{model}: {}", String::from_utf8_lossy(&out.stderr));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(got["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {got}"));
        assert!(v["n"].as_u64().is_some_and(|n| n <= 999) && (v["w"] == "yes" || v["w"] == "no"), "{model}: {v}");
    }
    // a schema that does not compile is the caller's error, named
    let out = c.brigade(&["generate", "--model", "stories", "-p", "Once", "--json-schema", r#"{"type": "strnig"}"#]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("format cannot be used"), "{err}");

    // 16 clients at once, different prompts and lengths: every answer complete and right
    let jobs: Vec<(String, usize)> = (0..16)
        .map(|i| (format!("{} {}", PROMPTS[i % 4], ["and", "so", "then", "but"][i / 4]), 8 + (i * 5) % 24))
        .collect();
    let expected: Vec<Vec<u32>> = jobs.iter().map(|(p, n)| run_ids(None, p, *n).1).collect();
    let c = std::sync::Arc::new(c);
    let handles: Vec<_> = jobs
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, (p, n))| {
            let c = c.clone();
            let model = if i % 2 == 0 { "stories" } else { "stories-grpc" };
            std::thread::spawn(move || ids(&c.generate(model, &p, n)["generated_ids"]))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), expected[i], "client {i}: {:?}", jobs[i]);
    }
    // status shows the planner's prediction beside what the sessions measured
    let st = c.status();
    let dep = st["deployments"].as_array().unwrap().iter().find(|d| d["name"] == "stories").unwrap().clone();
    assert!(dep["measured_decode_ms"].as_f64().unwrap() > 0.0, "{dep}");
    assert!(dep["predicted_decode_ms"].as_f64().unwrap() > 0.0, "{dep}");
    assert_eq!(st["nodes"].as_array().unwrap().len(), 3);
    assert!(st["nodes"][0]["devices"][0]["kernels"].as_array().unwrap().len() >= 3, "measured kernel rates");
}

/// A mixture whose routed experts live on other nodes than its layers' attention: the stages of
/// the pipeline call the expert stages for the rows routed there, over the same mTLS QUIC links
/// (and over gRPC), and the answer is `run`'s, id for id — every routed expert computed, none
/// dropped. Expert stages hold only their experts' bytes, and maps that cannot work are refused
/// with the reason, changing nothing.
#[test]
fn experts_held_on_other_nodes_answer_what_run_answers() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    for w in ["w1", "w2", "w3"] {
        c.start_worker(w, &[]);
    }
    c.wait_up(3);
    let moe = c.path("moe.gguf");
    let shape = ["--layers", "4", "--hidden", "256", "--ffn", "128", "--heads", "8", "--kv-heads", "4"];
    let experts = ["--vocab", "512", "--experts", "8", "--experts-used", "2", "--moe-family", "qwen3moe"];
    synth(&moe, &[&shape[..], &experts[..], &["--type", "q8_0"]].concat());
    let m = moe.to_str().unwrap();
    // the experts of every layer spread over two other nodes, some kept with the layers
    let spread =
        c.deploy(&["--name", "spread", "-m", m, "--device-map", "w1:cpu:4,w2:cpu:experts=0..3,w3:cpu:experts=5..8"]);
    assert_eq!(spread["state"], "ready", "{spread}");
    let held = spread["expert_stages"].as_array().unwrap();
    assert_eq!(held.len(), 2, "{spread}");
    assert_eq!((held[0]["index"].as_u64(), held[1]["index"].as_u64()), (Some(1), Some(2)));
    assert_eq!(held[1]["experts"], serde_json::json!([5, 8]));
    let pipeline_bytes = spread["stages"][0]["weight_bytes"].as_u64().unwrap();
    let w2 = held[0]["weight_bytes"].as_u64().unwrap();
    assert!(w2 > 0 && held.iter().all(|s| s["state"] == "ready"), "{spread}");
    // the plan's bytes for each stage (before any load) within 5% of what its worker holds: the
    // layers less the experts held elsewhere, and each expert stage's experts
    let plan = spread["plan"].as_str().unwrap();
    for s in spread["stages"].as_array().unwrap().iter().chain(held) {
        let node = s["node"].as_str().unwrap();
        let at = if s["experts"].is_null() { format!(" {node}/cpu  layers") } else { format!("on {node}/cpu") };
        let line = plan.lines().find(|l| l.contains(&at)).unwrap_or_else(|| panic!("{at}: {plan}"));
        let mut w = line.split_once("weights ").unwrap().1.split_whitespace();
        let (n, unit) = (w.next().unwrap(), w.next().unwrap());
        let scale = match unit {
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            _ => panic!("{line}"),
        };
        let predicted = n.parse::<f64>().unwrap() * scale;
        let held = s["weight_bytes"].as_u64().unwrap() as f64;
        assert!((predicted - held).abs() <= 0.05 * held, "{node}: planned {predicted} bytes, holds {held}\n{plan}");
    }
    // w1 holds 2 of 8 experts and the attention; w2 3 of 8: more than w1's share of experts
    assert!(w2 > pipeline_bytes / 3, "w2 holds {w2} bytes, w1 {pipeline_bytes}");
    // each node fetched its own share of the file (an expert is a range of its own), the three
    // together the file once, and the headers three times
    let size = std::fs::metadata(&moe).unwrap().len();
    let fetched: Vec<u64> = ["stages", "expert_stages"]
        .iter()
        .flat_map(|k| spread[k].as_array().unwrap().iter().map(|s| s["fetched_bytes"].as_u64().unwrap()))
        .collect();
    assert!(fetched.iter().all(|&f| f > 0 && f < size / 2), "{fetched:?} of a {size}-byte file");
    let total: u64 = fetched.iter().sum();
    assert!(total >= size * 95 / 100 && total <= size * 11 / 10, "{fetched:?} of a {size}-byte file");
    // two stages, and all the experts on the third node, over gRPC
    c.deploy(&[
        "--name",
        "apart",
        "-m",
        m,
        "--transport",
        "grpc",
        "--device-map",
        "w1:cpu:2,w2:cpu:2,w3:cpu:experts=0..8",
    ]);
    // transformers' Qwen3-MoE checkpoint directory, whose experts are tensors of their own
    let hf = root().join("tests/fixtures/families/qwen3moe/hf");
    let h = hf.to_str().unwrap();
    let d = c.deploy(&["--name", "hf", "-m", h, "--device-map", "w2:cpu:2,w3:cpu:1,w1:cpu:experts=2..7"]);
    let held = &d["expert_stages"][0];
    assert!(held["weight_bytes"].as_u64().unwrap() > 0 && held["fetched_bytes"].as_u64().unwrap() > 0, "{d}");
    for p in PROMPTS {
        let (prompt_ids, want) = run_ids(Some(&moe), p, 24);
        for model in ["spread", "apart"] {
            let got = c.generate(model, p, 24);
            assert_eq!(ids(&got["prompt_ids"]), prompt_ids, "{model}: {p}");
            assert_eq!(ids(&got["generated_ids"]), want, "{model}: {p}\n{}", c.logs());
        }
        let (_, want) = run_ids(Some(&hf), p, 16);
        assert_eq!(ids(&c.generate("hf", p, 16)["generated_ids"]), want, "hf: {p}");
    }
    // maps that cannot work: refused, and nothing is deployed
    for (map, why) in [
        ("w1:cpu:4,w2:cpu:experts=0..9", "has 8 experts per layer"),
        ("w1:cpu:4,w2:cpu:experts=4..2", "A < B"),
        ("w1:cpu:4,w2:cpu:experts=0..4,w3:cpu:experts=3..8", "expert stages 0 and 1"),
        ("w1:cpu:4,w9:cpu:experts=0..4", "unknown node `w9`"),
    ] {
        let out = c.brigade(&["deploy", "--name", "bad", "-m", m, "--device-map", map]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{map}: {err}");
    }
    let out = c.brigade(&["deploy", "--name", "bad", "--device-map", "w1:cpu:5,w2:cpu:experts=0..2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not a mixture of experts"), "{err}");
    let names: Vec<String> =
        c.status()["deployments"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
}

/// Split layers in a cluster (`deploy --n-cpu-moe`), as far as a machine without a GPU shows
/// them: each worker holds the experts of its layers below N in a shard in its RAM and the rest
/// of those layers on its device, and the answer is `run`'s: on one node, across two by hand,
/// and on a cluster of three as the planner places it. A node whose RAM cannot hold its layers
/// with their experts is refused with the numbers, changing nothing.
#[test]
fn split_layers_answer_what_run_answers_on_one_node_and_across_nodes() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    c.start_worker("w1", &[]);
    c.wait_up(1);
    let moe = c.path("moe.gguf");
    let shape = ["--layers", "4", "--hidden", "256", "--ffn", "128", "--heads", "8", "--kv-heads", "4"];
    let experts = ["--vocab", "512", "--experts", "8", "--experts-used", "2", "--moe-family", "qwen3moe"];
    synth(&moe, &[&shape[..], &experts[..], &["--type", "q4_k"]].concat());
    let m = moe.to_str().unwrap();
    let d = c.deploy(&["--name", "split", "-m", m, "--n-cpu-moe", "2"]);
    assert_eq!(d["state"], "ready", "{d}");
    assert!(c.logs().contains("experts of layers [0, 2) in RAM"), "{}", c.logs());
    c.start_worker("w2", &[]);
    c.start_worker("w3", &["--memory", "1MiB"]);
    c.wait_up(3);
    let d = c.deploy(&["--name", "two", "-m", m, "--n-cpu-moe", "3", "--device-map", "w1:cpu:2,w2:cpu:2"]);
    assert_eq!(d["state"], "ready", "{d}");
    assert!(c.logs().contains("experts of layers [2, 3) in RAM"), "{}", c.logs());
    // placed by the planner (across nodes it reserves each node's share of the experts)
    let d = c.deploy(&["--name", "planned", "-m", m, "--cpu-moe"]);
    assert_eq!(d["state"], "ready", "{d}");
    // neither flag: the coordinator searches the split, and on CPUs alone keeps whole layers
    let d = c.deploy(&["--name", "searched", "-m", m]);
    assert_eq!(d["state"], "ready", "{d}");
    assert!(!d["plan"].as_str().unwrap().contains("split layers"), "{d}");
    for p in &PROMPTS[..2] {
        let (_, want) = run_ids(Some(&moe), p, 16);
        for model in ["split", "two", "planned", "searched"] {
            assert_eq!(ids(&c.generate(model, p, 16)["generated_ids"]), want, "{model}: {p}\n{}", c.logs());
        }
    }
    // w3's 1 MiB holds no layer with its experts
    let out = c.brigade(&["deploy", "--name", "bad", "-m", m, "--cpu-moe", "--device-map", "w1:cpu:2,w3:cpu:2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("on w3/cpu, its budget is"), "{err}");
    let mut names: Vec<String> =
        c.status()["deployments"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect();
    names.sort();
    assert_eq!(names, ["planned", "searched", "split", "two"]);
}

/// A mixture whose layers, each with its experts, fit on none of three small nodes: deployed
/// without a map, the planner places the layers without their experts and shards the experts over
/// the memory left, and the answer is `run`'s.
#[test]
fn experts_too_big_for_any_node_are_placed_apart() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    for w in ["w1", "w2", "w3"] {
        c.start_worker(w, &["--memory", "6MiB"]);
    }
    c.wait_up(3);
    let moe = c.path("moe.gguf");
    let shape = ["--layers", "2", "--hidden", "256", "--ffn", "1024", "--heads", "8", "--kv-heads", "4"];
    let experts = ["--vocab", "512", "--experts", "8", "--experts-used", "2", "--moe-family", "qwen3moe"];
    synth(&moe, &[&shape[..], &experts[..], &["--type", "q8_0"]].concat());
    let m = moe.to_str().unwrap();
    let d = c.deploy(&["--name", "moe", "-m", m, "--ctx", "256", "--sessions", "1"]);
    assert_eq!(d["state"], "ready", "{d}");
    let held = d["expert_stages"].as_array().unwrap();
    assert!(held.len() >= 2, "{d}");
    let shards: Vec<(u64, u64)> =
        held.iter().map(|s| (s["experts"][0].as_u64().unwrap(), s["experts"][1].as_u64().unwrap())).collect();
    assert_eq!(shards.first().map(|x| x.0), Some(0), "{shards:?}");
    assert!(shards.windows(2).all(|w| w[0].1 == w[1].0) && shards.last().map(|x| x.1) == Some(8), "{shards:?}");
    assert!(d["plan"].as_str().unwrap().contains("sharded by id"), "{d}");
    for p in PROMPTS {
        let (prompt_ids, want) = run_ids(Some(&moe), p, 16);
        let got = c.generate("moe", p, 16);
        assert_eq!((ids(&got["prompt_ids"]), ids(&got["generated_ids"])), (prompt_ids, want), "{p}");
    }
}

/// Speculative decoding through three workers (each drives its sessions with `--spec-type
/// ngram-simple`): a drawn id and its draft go round the ring once, the last stage draws along
/// the rows and the stages drop what it did not take. The stories model and Gemma 3 (sliding
/// windows, cut three ways) answer what `run` answers without drafts, drafts were taken, and a
/// JSON schema still holds at temperature 1.2.
#[test]
fn three_drafting_workers_answer_what_run_answers() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    for w in ["w1", "w2", "w3"] {
        c.start_worker(w, &["--spec-type", "ngram-simple", "--spec-draft-n-max", "6"]);
    }
    c.wait_up(3);
    c.deploy(&["--name", "stories", "--device-map", "w1:cpu:2,w2:cpu:2,w3:cpu:1"]);
    let gemma3 = root().join("tests/fixtures/families/gemma3/gemma3-tiny-Q4_K_M.gguf");
    c.deploy(&["--name", "gemma3", "-m", gemma3.to_str().unwrap(), "--device-map", "w3:cpu:2,w1:cpu:3,w2:cpu:1"]);
    let (mut drafted, mut accepted) = (0, 0);
    for p in PROMPTS {
        for (model, file, n) in [("stories", None, 100), ("gemma3", Some(gemma3.as_path()), 48)] {
            let (_, want) = run_ids(file, p, n);
            let got = c.generate(model, p, n);
            assert_eq!(ids(&got["generated_ids"]), want, "{model}: {p}\n{}", c.logs());
            let t = &got["timings"];
            drafted += t["drafted_tokens"].as_u64().unwrap();
            accepted += t["accepted_tokens"].as_u64().unwrap();
            let passes = t["decode_passes"].as_u64().unwrap();
            assert_eq!(passes + t["accepted_tokens"].as_u64().unwrap(), want.len() as u64 - 1, "{model}: {t}");
        }
    }
    assert!(accepted > 0 && drafted >= accepted, "{accepted} of {drafted} drafted tokens taken");
    let schema = r#"{"type": "object", "properties": {"w": {"enum": ["yes", "no"]}}, "required": ["w"],
        "additionalProperties": false}"#;
    let args = ["generate", "--model", "stories", "-p", "Once", "-n", "48", "--temp", "1.2", "-s", "4"];
    let out = c.brigade(&[&args[..], &["--json-schema", schema, "--json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(got["text"].as_str().unwrap()).unwrap();
    assert!(v["w"] == "yes" || v["w"] == "no", "{v}");
}

#[test]
fn a_worker_fetches_only_its_slice_and_repairs_a_corrupt_cache() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    let model = c.path("m.gguf");
    synth_shape(&model, [6, 256, 768, 8, 8, 512], "q8_0");
    // w1 has the file in its models dir: used in place; w2 has nothing
    std::fs::create_dir_all(c.path("w1/models")).unwrap();
    std::fs::copy(&model, c.path("w1/models/m.gguf")).unwrap();
    c.start_worker("w1", &[]);
    c.start_worker("w2", &[]);
    c.wait_up(2);
    let d = c.deploy(&["--name", "m", "-m", model.to_str().unwrap(), "--device-map", "w1:cpu:3,w2:cpu:3"]);
    let fetched = stage_fetched(&d);
    assert_eq!(fetched[0], 0, "w1 used its own copy");
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(fetched[1] < size * 7 / 10, "w2 fetched {} of {size} bytes", fetched[1]);
    let (_, want) = run_ids(Some(&model), "Once upon a time", 12);
    assert_eq!(ids(&c.generate("m", "Once upon a time", 12)["generated_ids"]), want);

    // flip one byte of a tensor in w2's cache, restart w2: that tensor alone is fetched again
    let g = brigade_model::gguf::Gguf::parse(&std::fs::read(&model).unwrap()).unwrap();
    let t = g.tensor("blk.4.ffn_down.weight").unwrap();
    let id = d["model_id"].as_str().unwrap().to_string();
    let cached = c.path(&format!("w2/models/{id}/m.gguf"));
    let mut bytes = std::fs::read(&cached).unwrap();
    bytes[(t.offset + 17) as usize] ^= 0x10;
    c.worker("w2").kill9();
    std::fs::write(&cached, &bytes).unwrap();
    c.start_worker("w2", &[]);
    wait_until("w2 to reload its slice", Duration::from_secs(60), || {
        let st = c.status();
        let d = st["deployments"].as_array().unwrap().iter().find(|d| d["name"] == "m").cloned().unwrap();
        d["state"] == "ready" && d["stages"][1]["fetched_bytes"].as_u64() == Some(t.n_bytes)
    });
    assert_eq!(
        std::fs::read(&cached).unwrap()[(t.offset + 17) as usize],
        std::fs::read(&model).unwrap()[(t.offset + 17) as usize]
    );
    assert_eq!(ids(&c.generate("m", "Once upon a time", 12)["generated_ids"]), want);
}

#[test]
fn the_coordinator_comes_back_from_kill_9_with_everything() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    c.start_worker("w1", &[]);
    c.start_worker("w2", &[]);
    c.wait_up(2);
    c.deploy(&["--name", "stories", "--device-map", "w1:cpu:3,w2:cpu:2"]);
    let (_, want) = run_ids(None, "Once upon a time", 20);
    assert_eq!(ids(&c.generate("stories", "Once upon a time", 20)["generated_ids"]), want);
    let token = std::fs::read(c.path("coordinator/token")).unwrap();
    let ca = std::fs::read(c.path("coordinator/ca.pem")).unwrap();
    let before = c.status();

    c.coordinator.as_mut().unwrap().kill9();
    c.start_coordinator(&[]);
    // the workers reconnect by themselves; the deployment is there without redeploying
    c.wait_up(2);
    wait_until("the deployment to be ready again", Duration::from_secs(30), || {
        c.status()["deployments"][0]["state"] == "ready"
    });
    let after = c.status();
    assert_eq!(after["deployments"][0]["generation"], before["deployments"][0]["generation"]);
    // the same stages on the same nodes, ready; measured timings are the new process's own
    let stages = |v: &serde_json::Value| {
        let mut s = v["deployments"][0]["stages"].clone();
        for x in s.as_array_mut().unwrap() {
            x.as_object_mut().unwrap().remove("measured_ms");
        }
        s
    };
    assert_eq!(stages(&after), stages(&before));
    assert_eq!(std::fs::read(c.path("coordinator/token")).unwrap(), token);
    assert_eq!(std::fs::read(c.path("coordinator/ca.pem")).unwrap(), ca);
    assert_eq!(ids(&c.generate("stories", "Once upon a time", 20)["generated_ids"]), want);
    // the token still admits new nodes
    c.start_worker("w3", &[]);
    c.wait_up(3);
    // and the secrets are the owner's only
    use std::os::unix::fs::PermissionsExt;
    for f in ["token", "ca.key", "coordinator.key"] {
        let mode = std::fs::metadata(c.path(&format!("coordinator/{f}"))).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    // a worker hosting a stage, and the coordinator, stop on SIGTERM (as systemd and Kubernetes
    // stop them): a stage's thread ends although the router still holds its input
    for name in ["w1", "coordinator"] {
        let p = if name == "coordinator" { c.coordinator.as_mut().unwrap() } else { c.worker(name) };
        assert_eq!(unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) }, 0);
        let t0 = std::time::Instant::now();
        while p.exited().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(10), "{name} did not stop on SIGTERM:\n{}", p.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn intruders_are_refused_and_change_nothing() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    c.start_worker("w1", &[]);
    c.wait_up(1);
    c.deploy(&["--name", "stories", "--device-map", "w1:cpu:5"]);
    let before = c.status();

    // a wrong join token: the worker stops with the reason, the cluster never hears of it
    let mut args = c.worker_args("intruder");
    let i = args.iter().position(|a| a == "--join-token").unwrap();
    args[i + 1] = brigade_transport::join::new_join_token();
    c.start_worker_with("intruder", args);
    wait_until("the intruder to give up", Duration::from_secs(30), || c.worker("intruder").exited().is_some());
    let log = c.worker("intruder").log_text();
    assert!(log.contains("join token"), "{log}");
    assert!(!c.worker("intruder").exited().unwrap().success());

    // a node holding a certificate of another cluster's CA
    let mut other = Cluster::new();
    other.start_coordinator(&[]);
    other.start_worker("alien", &[]);
    other.wait_up(1);
    other.worker("alien").kill9();
    let mut args = c.worker_args("alien");
    let i = args.iter().position(|a| a == "--data-dir").unwrap();
    args[i + 1] = other.path("alien").display().to_string();
    c.start_worker_with("alien", args);
    std::thread::sleep(Duration::from_secs(3));
    let log = c.worker("alien").log_text();
    assert!(
        log.contains("coordinator") && (log.to_lowercase().contains("certificate") || log.contains("tls")),
        "{log}"
    );

    // a client of another protocol version
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ca_pem = std::fs::read_to_string(c.ca()).unwrap();
    let addr = c.addr();
    let err = rt.block_on(async move {
        use brigade_proto::v1::client_client::ClientClient;
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
        let tls =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).domain_name("coordinator.brigade");
        let ch =
            Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap().connect().await.unwrap();
        let mut cl = ClientClient::new(ch);
        let mut req = tonic::Request::new(brigade_proto::v1::ClusterStatusRequest {});
        req.metadata_mut().insert("brigade-protocol", "99".parse().unwrap());
        cl.cluster_status(req).await.unwrap_err()
    });
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let ours = brigade_proto::PROTOCOL_VERSION.to_string();
    assert!(err.message().contains("99") && err.message().contains(&ours), "{}", err.message());

    // stage links: a peer holding another CA's certificate is refused by w1's QUIC endpoint; a
    // certificate of this CA that no node was admitted with has its link closed, and the frames
    // it sends for no session (stale generation, garbage shapes) compute nothing
    let w1_addr: std::net::SocketAddr = before["nodes"][0]["address"].as_str().unwrap().parse().unwrap();
    let own_ca = brigade_transport::ClusterCa::from_pem(
        &std::fs::read_to_string(c.path("coordinator/ca.pem")).unwrap(),
        &std::fs::read_to_string(c.path("coordinator/ca.key")).unwrap(),
    )
    .unwrap();
    rt.block_on(async {
        use brigade_transport::{ClusterCa, Frame, QuicEndpoint, Role};
        let other = ClusterCa::generate("other").unwrap();
        let id = other.new_identity("w9", Role::Node).unwrap();
        let ep = QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &id, other.cert_pem()).unwrap();
        let refused = tokio::time::timeout(Duration::from_secs(15), ep.connect(w1_addr, "w1")).await.unwrap();
        assert!(refused.is_err(), "a certificate of another CA was accepted");
        let id = own_ca.new_identity("w9", Role::Node).unwrap();
        let ep = QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &id, own_ca.cert_pem()).unwrap();
        // a certificate of this CA that was never admitted (minted with the CA key, as a thief
        // of it would): the link is closed, whatever it sends
        let mut link = ep.connect(w1_addr, "w1").await.unwrap();
        let bogus = Frame::tokens(0, 0, &[1, 2, 3]).in_session("stories", 999, 42);
        let _ = link.send(bogus).await;
        let hidden = Frame::hidden_f32(0, 5, 1, 64, &[0.5; 64], brigade_proto::v1::WireDtype::F32)
            .unwrap()
            .in_session("stories", 1, 43);
        let _ = link.send(hidden).await;
        let closed = tokio::time::timeout(Duration::from_secs(5), link.recv()).await;
        assert!(matches!(closed, Ok(None)), "the link of a never-admitted certificate stayed open");
    });

    // nothing changed: same nodes, same deployment, still serving
    let after = c.status();
    let names: Vec<&str> = after["nodes"].as_array().unwrap().iter().map(|n| n["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["w1"]);
    assert_eq!(after["deployments"], before["deployments"]);
    let (_, want) = run_ids(None, "The cat", 10);
    assert_eq!(ids(&c.generate("stories", "The cat", 10)["generated_ids"]), want);
}

/// A coordinator started on a data dir whose raft log is gone, or beside half a CA, refuses to
/// begin a new cluster (which would forget every node and deployment) and says what to do; the
/// k8s template's placeholder is refused as a join token. Each refusal is bounded by 30 s.
#[test]
fn a_lost_log_half_a_ca_or_a_placeholder_token_starts_no_new_cluster() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    c.start_worker("w1", &[]);
    c.wait_up(1);
    let dir = c.path("coordinator");
    let marker = dir.join("initialised");
    wait_until("the initialised marker", Duration::from_secs(10), || marker.exists());
    let refused = |c: &mut Cluster, name: &str, extra: &[&str], want: &str| {
        let listen = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["coordinator", "--listen", &listen, "--data-dir", dir.to_str().unwrap()];
        args.extend_from_slice(extra);
        let mut p = c.spawn(name, &args);
        wait_until(&format!("{name} to refuse"), Duration::from_secs(30), || p.exited().is_some());
        assert!(!p.exited().unwrap().success());
        let log = p.log_text();
        assert!(log.contains(want), "{log}");
    };
    c.coordinator.take().unwrap().kill9();
    // the log deleted, then an empty file in its place
    std::fs::remove_file(dir.join("raft.redb")).unwrap();
    refused(&mut c, "no-log", &[], "--force-new-cluster");
    assert!(!dir.join("raft.redb").exists() || std::fs::metadata(dir.join("raft.redb")).unwrap().len() == 0);
    std::fs::write(dir.join("raft.redb"), b"").unwrap();
    refused(&mut c, "empty-log", &[], "--force-new-cluster");
    // the operator means it: a new cluster on the same CA
    std::fs::remove_file(dir.join("raft.redb")).unwrap();
    c.start_coordinator(&["--force-new-cluster"]);
    assert!(c.status()["deployments"].as_array().is_none_or(|d| d.is_empty()));
    c.coordinator.take().unwrap().kill9();
    // half a CA pair: never a new CA beside it
    std::fs::remove_file(dir.join("ca.key")).unwrap();
    refused(&mut c, "half-ca", &[], "half a cluster CA");
    assert!(!dir.join("ca.key").exists());

    // the placeholder shipped in deploy/k8s/secret.yaml is not a token
    let yaml = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/k8s/secret.yaml")).unwrap();
    let placeholder = yaml.lines().find_map(|l| l.trim().strip_prefix("token:")).unwrap().trim().to_string();
    let fresh = c.path("fresh-ca");
    for bad in [placeholder.as_str(), "brg1-0123456789abcdef", "brg1-replace-me-with-random-hex-0123456789abcdef"] {
        let out = std::process::Command::new(BIN)
            .args(["coordinator", "init", "--data-dir", fresh.to_str().unwrap(), "--join-token", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad} was taken as a join token");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--join-token"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!fresh.join("token").exists() && !fresh.join("ca.key").exists());
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Callers without a certificate cost the coordinator neither memory nor its port. Bounds:
/// four `Raft.Step` calls that announce a 200 MiB message and send 4 MiB of it are each refused
/// with PERMISSION_DENIED within 5 s — before the body is read — and the coordinator's RSS grows
/// by less than 64 MiB (it grew by 1 GB when the check ran in the handler); an oversized
/// `JoinReplica` is refused by its 4 KiB limit, a 2 MiB `Join` by the 1 MiB cap on callers
/// without a certificate; TCP connections that never start TLS are closed
/// within 10 s; and the coordinator still answers.
#[test]
fn callers_without_a_certificate_hold_no_memory_and_no_connection() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    let pid = c.coordinator.as_ref().unwrap().child.id();
    let before = rss_kib(pid);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ca_pem = std::fs::read_to_string(c.ca()).unwrap();
    let addr = c.addr();
    rt.block_on(async move {
        use tonic::codegen::http;
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
        use tower::ServiceExt as _;
        let tls =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).domain_name("coordinator.brigade");
        let ch =
            Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap().connect().await.unwrap();
        let mut held = Vec::new();
        for _ in 0..4 {
            // the gRPC prefix of a 200 MiB message, then 4 MiB of it, then nothing (the sender stays)
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>(8);
            let mut first = vec![0u8];
            first.extend_from_slice(&(200u32 << 20).to_be_bytes());
            first.extend(std::iter::repeat_n(7u8, 4 << 20));
            tx.send(Ok(http_body::Frame::data(bytes::Bytes::from(first)))).await.unwrap();
            held.push(tx);
            let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            let req = http::Request::builder()
                .method("POST")
                .uri(format!("https://{addr}/brigade.v1.Raft/Step"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .header("brigade-protocol", brigade_proto::PROTOCOL_VERSION.to_string())
                .body(tonic::body::Body::new(body))
                .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(5), ch.clone().oneshot(req))
                .await
                .expect("a half-sent Raft.Step was not answered within 5 s")
                .unwrap();
            let status = tonic::Status::from_header_map(resp.headers());
            let code = status.as_ref().map(|s| s.code());
            assert_eq!(code, Some(tonic::Code::PermissionDenied), "{:?}", resp.headers());
        }
        // JoinReplica is open to callers without a certificate, but only for small messages
        let mut join = brigade_proto::v1::replica_join_client::ReplicaJoinClient::with_interceptor(
            ch.clone(),
            brigade_proto::VersionInterceptor,
        );
        let err = join
            .join_replica(brigade_proto::v1::ReplicaJoinRequest {
                protocol: brigade_proto::PROTOCOL_VERSION,
                id: 9,
                address: "x".repeat(64 << 10),
                nonce: vec![0; 32],
                proof: vec![0; 32],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange, "{}", err.message());
        // every other call without a certificate (a worker's Join, an SDK's requests) is capped
        // at 1 MiB, whatever its service's own limit
        let mut control = brigade_proto::v1::control_client::ControlClient::with_interceptor(
            ch.clone(),
            brigade_proto::VersionInterceptor,
        );
        let err = control
            .join(brigade_proto::v1::JoinRequest {
                protocol: brigade_proto::PROTOCOL_VERSION,
                name: "w9".into(),
                nonce: vec![0; 32],
                proof: vec![0; 32],
                csr_pem: "x".repeat(2 << 20),
            })
            .await
            .unwrap_err();
        assert!(err.message().contains("length limit"), "{:?}: {}", err.code(), err.message());
        drop(held);
    });
    let grown = rss_kib(pid).saturating_sub(before);
    assert!(grown < 64 << 10, "the coordinator grew by {grown} KiB for callers without a certificate");

    // connections that never start TLS are closed by the handshake timeout
    use std::io::Read;
    let mut silent: Vec<std::net::TcpStream> =
        (0..20).map(|_| std::net::TcpStream::connect(c.addr()).unwrap()).collect();
    let t0 = std::time::Instant::now();
    for s in &mut silent {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 16];
        let read = s.read(&mut buf);
        let closed =
            matches!(&read, Ok(0)) || read.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset);
        assert!(closed, "a silent connection was still open after {:?}: {read:?}", t0.elapsed());
    }
    assert!(c.status()["nodes"].as_array().is_none_or(|n| n.is_empty()));
}

/// Stage sessions are opened only by the node assigned to send to that stage, only with the
/// certificate it was admitted with, and a session nobody drives is ended after the worker's
/// `--session-idle-s`. Each attack sends as many OPEN frames as the stage has sessions, so any
/// one that got through would leave no session for real requests ("all 2 sessions … in use"):
/// - a re-minted certificate of `w1` (the admitted one is different: as after a re-join) — the
///   link is closed within 5 s, and it fetches no model bytes from the coordinator or from w2;
/// - w2's real certificate sending to w1's first stage, which only the driver (w1) feeds;
/// - w1's real certificate opening sessions on w2's stage and abandoning them: ended after the
///   2 s idle limit, after which the real request is served.
#[test]
fn only_the_assigned_sender_opens_sessions_and_abandoned_ones_expire() {
    use brigade_transport::{Frame, Identity, QuicEndpoint, Role};
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    c.start_worker("w1", &[]);
    c.start_worker("w2", &["--session-idle-s", "2"]);
    c.wait_up(2);
    let d = c.deploy(&["--name", "stories", "--device-map", "w1:cpu:3,w2:cpu:2", "--sessions", "2"]);
    assert_eq!(d["state"], "ready", "{d}");
    let generation = d["generation"].as_u64().unwrap();
    let status = c.status();
    let address = |name: &str| -> std::net::SocketAddr {
        let nodes = status["nodes"].as_array().unwrap();
        let n = nodes.iter().find(|n| n["name"] == name).unwrap();
        n["address"].as_str().unwrap().parse().unwrap()
    };
    let (w1_addr, w2_addr) = (address("w1"), address("w2"));
    let ca_pem = std::fs::read_to_string(c.path("coordinator/ca.pem")).unwrap();
    let ca = brigade_transport::ClusterCa::from_pem(
        &ca_pem,
        &std::fs::read_to_string(c.path("coordinator/ca.key")).unwrap(),
    )
    .unwrap();
    let held = |name: &str| Identity {
        cert_chain_pem: std::fs::read_to_string(c.path(&format!("{name}/node.pem"))).unwrap(),
        key_pem: std::fs::read_to_string(c.path(&format!("{name}/node.key"))).unwrap(),
    };
    let (w1_real, w2_real) = (held("w1"), held("w2"));
    let w1_reminted = ca.new_identity("w1", Role::Node).unwrap();
    let spec = brigade_proto::v1::SessionSpec {
        sampling: None,
        prompt_ids: vec![1, 2, 3],
        max_tokens: 4,
        ..Default::default()
    };
    let opens = |stage: u32| -> Vec<Frame> {
        (0..2u64)
            .map(|i| {
                let mut f = Frame::open(&spec).in_session("stories", generation, 9000 + u64::from(stage) * 10 + i);
                f.header.stage = stage;
                f
            })
            .collect()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = c.addr();
    rt.block_on(async {
        // the re-minted certificate: its link is closed, its fetches refused
        let ep = QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &w1_reminted, &ca_pem).unwrap();
        let mut link = ep.connect(w2_addr, "w2").await.unwrap();
        for f in opens(1) {
            let _ = link.send(f).await;
        }
        let closed = tokio::time::timeout(Duration::from_secs(5), link.recv()).await;
        assert!(matches!(closed, Ok(None)), "the link of a revoked certificate stayed open: {closed:?}");
        let request = brigade_proto::v1::FetchRangeRequest {
            model_id: "embedded".into(),
            file: "stories260K.gguf".into(),
            offset: 0,
            length: 64,
        };
        let ch = brigade_transport::grpc::coordinator_channel(&format!("https://{addr}"), &w1_reminted, &ca_pem)
            .await
            .unwrap();
        let mut control =
            brigade_proto::v1::control_client::ControlClient::with_interceptor(ch, brigade_proto::VersionInterceptor);
        let err = control.fetch_range(request.clone()).await.err().map(|s| s.code());
        assert_eq!(err, Some(tonic::Code::PermissionDenied));
        let ch =
            brigade_transport::grpc::channel(&format!("https://{w2_addr}"), &w1_reminted, &ca_pem, "w2.node.brigade")
                .await
                .unwrap();
        let mut stage =
            brigade_proto::v1::stage_client::StageClient::with_interceptor(ch, brigade_proto::VersionInterceptor);
        let err = stage.fetch_range(request).await.err().map(|s| s.code());
        assert_eq!(err, Some(tonic::Code::PermissionDenied));

        // w2, admitted, but not the driver that feeds w1's first stage
        let ep = QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &w2_real, &ca_pem).unwrap();
        let link = ep.connect(w1_addr, "w1").await.unwrap();
        for f in opens(0) {
            link.send(f).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    let (_, want) = run_ids(None, "The cat", 10);
    assert_eq!(ids(&c.generate("stories", "The cat", 10)["generated_ids"]), want);
    assert!(c.worker("w1").log_text().contains("only w1 sends to this stage"));

    // w1's own certificate opens both of w2's sessions and walks away
    rt.block_on(async {
        let ep = QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &w1_real, &ca_pem).unwrap();
        let link = ep.connect(w2_addr, "w2").await.unwrap();
        for f in opens(1) {
            link.send(f).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(link);
    });
    wait_until("w2 to end the abandoned sessions", Duration::from_secs(10), || {
        c.worker("w2").log_text().matches("session ended").count() >= 2
    });
    assert_eq!(ids(&c.generate("stories", "The cat", 10)["generated_ids"]), want);
}

/// `deploy -m` names a file on the coordinator's machine: with `--models-dir` only files under
/// it (a path outside, `..`, or a link out of it is refused); a FIFO is refused at once instead
/// of holding a thread for ever (bound: 10 s); a file that is not a model is refused without its
/// first bytes in the error; a model inside the directory deploys by its relative name.
#[test]
fn deploy_reads_only_regular_model_files_under_the_models_dir() {
    let mut c = Cluster::new();
    let models = c.path("models");
    std::fs::create_dir_all(&models).unwrap();
    let secret = c.path("secret.txt");
    std::fs::write(&secret, "hunter2-is-the-password\n").unwrap();
    std::fs::write(models.join("notes.gguf"), "hunter2-is-the-password\n").unwrap();
    std::os::unix::fs::symlink(&secret, models.join("link.gguf")).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(models.join("pipe.gguf")).status().unwrap().success());
    synth_shape(&models.join("tiny.gguf"), [2, 64, 128, 4, 4, 512], "f32");
    c.start_coordinator(&["--models-dir", models.to_str().unwrap()]);
    c.start_worker("w1", &[]);
    c.wait_up(1);
    let refused = |m: &str, want: &str| {
        let t0 = std::time::Instant::now();
        let out = c.brigade(&["deploy", "--name", "x", "-m", m, "--device-map", "w1:cpu:2"]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{m} was deployed");
        assert!(err.contains(want), "{m}: {err}");
        assert!(!err.contains("hunter2") && !err.contains("68, 75"), "{m}: the error quotes the file: {err}");
        assert!(t0.elapsed() < Duration::from_secs(10), "{m} took {:?}", t0.elapsed());
    };
    refused(secret.to_str().unwrap(), "outside the models directory");
    refused("../secret.txt", "outside the models directory");
    refused("link.gguf", "outside the models directory");
    refused("pipe.gguf", "neither a regular file");
    refused("notes.gguf", "not a GGUF file");
    let d = c.deploy(&["--name", "tiny", "-m", "tiny.gguf", "--device-map", "w1:cpu:2"]);
    assert_eq!(d["state"], "ready", "{d}");
}

/// The metric `name` of a worker's `/metrics` for one stage of a deployment.
fn stage_metric(metrics: &str, name: &str, deployment: &str, stage: u32) -> f64 {
    let want = format!("deployment=\"{deployment}\"");
    let stage = format!("stage=\"{stage}\"");
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l.contains(&want) && l.contains(&stage))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} for {deployment} stage {stage} in:\n{metrics}"))
}

/// GPU gateways, the half CI can run (it has no GPU): a worker registers every device it offers
/// with its figures; a deployment naming a device a node lacks is refused at deploy time, naming
/// both; a worker asked to offer a GPU in a build without CUDA stops and says why; and a node that
/// hosts consecutive stages hands the hidden state from one to the next in process. That hop is
/// the one a CPU↔GPU pair of stages takes on a gateway (the next slice moves the tensor to its
/// device, as the single box's pipeline does); here both sides are the CPU, so the test checks
/// the path — no bytes on any link, `run`'s greedy ids — not a device copy.
#[test]
fn a_node_offers_its_devices_and_hosts_consecutive_stages_in_process() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    let metrics = format!("127.0.0.1:{}", free_port());
    c.start_worker("w1", &["--metrics", &metrics, "--devices", "all"]);
    c.start_worker("w2", &["--devices", "cpu", "--memory", "2GiB"]);
    c.wait_up(2);

    // the registration carries the device list with the measured figures
    let st = c.status();
    for n in st["nodes"].as_array().unwrap() {
        let devs = n["devices"].as_array().unwrap();
        assert_eq!(devs.len(), 1, "a CPU-only build offers the CPU alone: {n}");
        assert_eq!((devs[0]["name"].as_str(), devs[0]["kind"].as_str()), (Some("cpu"), Some("cpu")), "{n}");
        assert!(devs[0]["memory_free"].as_u64().unwrap() > 0, "{n}");
        assert!(!devs[0]["kernels"].as_array().unwrap().is_empty(), "{n}");
    }
    let w2 = st["nodes"].as_array().unwrap().iter().find(|n| n["name"] == "w2").unwrap();
    assert!(w2["devices"][0]["memory_free"].as_u64().unwrap() <= 2 << 30, "--memory caps what w2 offers: {w2}");

    // a GPU this build cannot use: the worker stops with the reason
    let mut gpu = c.spawn(
        "w3",
        &c.worker_args("w3").iter().map(String::as_str).chain(["--devices", "cpu,cuda0"]).collect::<Vec<_>>(),
    );
    wait_until("w3 to refuse cuda0", Duration::from_secs(60), || gpu.exited().is_some());
    assert!(!gpu.exited().unwrap().success());
    let log = gpu.log_text();
    assert!(log.contains("cuda0") && log.contains("built without CUDA"), "{log}");

    // a device the node lacks is refused when deploying, with the node and the device named,
    // and nothing is deployed
    let out = c.brigade(&["deploy", "--name", "nope", "--device-map", "w1:cuda0:3,w2:cpu:2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node `w1` has no device `cuda0` (it has cpu)"), "{err}");
    assert!(c.status()["deployments"].as_array().unwrap().iter().all(|d| d["name"] != "nope"));

    // two consecutive stages on w1 (the driver's node): every hop in process. bf16 between
    // nodes would round the hidden state; in process it stays as computed, so the ids are the
    // f32 single box's
    // (`all`: the layers the other entries leave, 3 of the 5)
    c.deploy(&["--name", "here", "--device-map", "w1:cpu:2,w1:cpu:all", "--activation-dtype", "bf16"]);
    // and mixed: w2 first (the driver), then two stages on w1 — a network hop, then one in process
    c.deploy(&["--name", "mixed", "--device-map", "w2:cpu:1,w1:cpu:2,w1:cpu:2", "--driver", "w2"]);
    for p in PROMPTS {
        let (_, want) = run_ids(None, p, 24);
        for model in ["here", "mixed"] {
            let g = c.generate(model, p, 24);
            assert_eq!(ids(&g["generated_ids"]), want, "{model}: {p}\n{}", c.logs());
            // what each hop puts on a link per token: nothing inside w1; `mixed` sends w2's
            // hidden state (64 f32) to w1, and the last stage's id back to the driver on w2
            let bytes: Vec<u64> =
                g["hops"].as_array().unwrap().iter().map(|h| h["bytes_per_token"].as_u64().unwrap()).collect();
            let want_bytes: &[u64] = if model == "here" { &[0, 0] } else { &[256, 0, 4] };
            assert_eq!(bytes, want_bytes, "{model}: {g}");
        }
    }
    let here = c.status()["deployments"].as_array().unwrap().iter().find(|d| d["name"] == "here").unwrap().clone();
    let ranges: Vec<String> = here["stages"].as_array().unwrap().iter().map(|s| s["layers"].to_string()).collect();
    assert_eq!(ranges, ["[0,2]", "[2,5]"], "{here}");
    let m = http(&format!("http://{metrics}"), "GET", "/metrics", None);
    for (dep, stage) in [("here", 0), ("mixed", 1)] {
        assert!(stage_metric(&m, "brigade_worker_hop_handed_over_total", dep, stage) > 0.0, "{dep} {stage}:\n{m}");
        assert_eq!(stage_metric(&m, "brigade_worker_hop_sent_bytes_total", dep, stage), 0.0, "{dep} {stage}:\n{m}");
    }
    // the sessions have ended, but their KV caches stay pooled for the next: memory held
    for stage in [0, 1] {
        assert!(stage_metric(&m, "brigade_worker_stage_kv_cache_bytes", "here", stage) > 0.0, "{m}");
    }
    // the last stage sends the sampled ids to the driver: on w1 for `here` (in process, as a
    // frame: no bytes on a link), over the link to w2 for `mixed`
    assert_eq!(stage_metric(&m, "brigade_worker_hop_sent_bytes_total", "here", 1), 0.0, "{m}");
    assert!(stage_metric(&m, "brigade_worker_hop_sent_bytes_total", "mixed", 2) > 0.0, "{m}");
}
