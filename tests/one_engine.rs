//! One engine, one answer: the same request, with every sampling parameter (the penalties
//! included, greedy and seeded), gives the same text from `brigade serve`, from `brigade run`,
//! from a coordinator's OpenAI API over deployments on one, two and three workers, from gRPC
//! `Generate` (the CLI, through the Rust SDK) and from the Python SDK — with and without a stop
//! string. Before the sampling parameters had one definition the cluster dropped
//! `presence_penalty` and `frequency_penalty`; before stop strings had one, gRPC had none.
#![allow(clippy::unwrap_used)]

mod support;

use serde_json::{json, Value};
use std::process::Command;
use support::{root, serve, Cluster, BIN};

const PROMPT: &str = "Once upon a time";
const N: u64 = 40;

/// The sampling fields of each case, as an OpenAI request carries them (brigade's extensions
/// `top_k`, `min_p`, `repeat_penalty`, `repeat_last_n` included).
fn cases() -> Vec<(&'static str, Value)> {
    vec![
        ("greedy", json!({"temperature": 0})),
        ("greedy-openai-penalties", json!({"temperature": 0, "presence_penalty": 1.2, "frequency_penalty": 0.8})),
        ("greedy-repeat", json!({"temperature": 0, "repeat_penalty": 1.5, "repeat_last_n": 16})),
        (
            "seeded-all",
            json!({"temperature": 0.9, "seed": 1234, "top_k": 20, "top_p": 0.9, "min_p": 0.02,
                   "repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.6, "frequency_penalty": 0.4}),
        ),
        (
            "seeded-hot",
            json!({"temperature": 1.3, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                              "presence_penalty": -0.5, "frequency_penalty": 1.5}),
        ),
    ]
}

/// A POST of a JSON body; the parsed JSON answer (status 200 asserted).
fn post(base: &str, path: &str, body: &Value) -> Value {
    let answer = support::http(base, "POST", path, Some(&body.to_string()));
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

fn completion(base: &str, model: &str, sampling: &Value, stop: Option<&str>) -> String {
    let mut body = json!({"model": model, "prompt": PROMPT, "max_tokens": N});
    for (k, v) in sampling.as_object().unwrap() {
        body[k] = v.clone();
    }
    if let Some(s) = stop {
        body["stop"] = json!([s]);
    }
    let r = post(base, "/v1/completions", &body);
    r["choices"][0]["text"].as_str().unwrap_or_else(|| panic!("no text in {r}")).to_string()
}

/// The same sampling as command-line flags (`run`, `generate`).
fn flags(sampling: &Value) -> Vec<String> {
    let mut f = vec!["-n".to_string(), N.to_string()];
    for (k, v) in sampling.as_object().unwrap() {
        let flag = match k.as_str() {
            "temperature" => "--temp".to_string(),
            other => format!("--{}", other.replace('_', "-")),
        };
        f.extend([flag, v.to_string()]);
    }
    f
}

fn text_of(out: &std::process::Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

/// The Python SDK (target/venv, which .ci/run makes): one `generate` per case and deployment;
/// a JSON object `{"deployment/case": text}`.
fn python_sdk(c: &Cluster, models: &[&str], cases: &[(String, Value)]) -> Value {
    let script = r#"
import json, sys
from brigade_client import Client
addr, ca, models, cases, n, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
out = {}
with Client(addr, ca=ca) as client:
    for m in models:
        for name, kw in cases:
            out[m + "/" + name] = client.generate(m, prompt, max_tokens=n, **kw).result()
print(json.dumps(out))
"#;
    let py = root().join("target/venv/bin/python");
    assert!(py.exists(), "{} is missing: run .ci/run (it makes target/venv with the SDK)", py.display());
    let out = Command::new(py)
        .args(["-c", script, &c.addr(), c.ca().to_str().unwrap()])
        .arg(serde_json::to_string(models).unwrap())
        .arg(serde_json::to_string(cases).unwrap())
        .args([N.to_string(), PROMPT.to_string()])
        .env_remove("BRIGADE_CONFIG")
        .output()
        .unwrap();
    assert!(out.status.success(), "python SDK: {}\n{}", String::from_utf8_lossy(&out.stderr), c.logs());
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn every_entry_point_gives_the_same_text_for_every_sampling_parameter() {
    let mut server = serve(&["--parallel", "2", "--alias", "stories"]);
    let mut c = Cluster::new();
    c.start_coordinator(&["--http", "127.0.0.1:0"]);
    for w in ["w1", "w2", "w3"] {
        c.start_worker(w, &[]);
    }
    c.wait_up(3);
    // the embedded model's five layers on one, two and three workers
    let deployments = [("one", "w1:cpu:5"), ("two", "w1:cpu:3,w2:cpu:2"), ("three", "w1:cpu:2,w2:cpu:2,w3:cpu:1")];
    for (name, map) in deployments {
        let d = c.deploy(&["--name", name, "--device-map", map]);
        assert_eq!(d["state"], "ready", "{d}");
    }
    let models: Vec<&str> = deployments.iter().map(|d| d.0).collect();
    let http = std::fs::read_to_string(c.path("coordinator").join("coordinator.http.addr")).unwrap();
    let coord = format!("http://{}", http.trim());

    let cases = cases();
    let mut reference = std::collections::BTreeMap::new();
    let mut py_cases: Vec<(String, Value)> = Vec::new();
    for (name, sampling) in &cases {
        let want = completion(&server.url, "stories", sampling, None);
        assert!(!want.is_empty(), "{name}: serve generated nothing");
        // the single box's other engine (`run`, one session in one process)
        let mut args: Vec<String> = vec!["run".into(), "-p".into(), PROMPT.into(), "--json".into()];
        args.extend(flags(sampling));
        let run = Command::new(BIN).args(&args).env_remove("BRIGADE_CONFIG").output().unwrap();
        assert_eq!(text_of(&run, &format!("run {name}")), want, "{name}: `run` and `serve` differ");
        for m in &models {
            let got = completion(&coord, m, sampling, None);
            assert_eq!(got, want, "{name}: the coordinator's API over `{m}` differs from `serve`\n{}", c.logs());
            let mut args: Vec<String> = vec!["generate".into(), "--model".into(), m.to_string(), "-p".into()];
            args.extend([PROMPT.to_string(), "--json".into()]);
            args.extend(flags(sampling));
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let grpc = text_of(&c.brigade(&refs), &format!("generate {name} on {m}"));
            assert_eq!(grpc, want, "{name}: gRPC Generate over `{m}` differs from `serve`");
        }
        // a stop string from the middle of the text: every API cuts the same text before it
        let chars: Vec<char> = want.chars().collect();
        if chars.len() >= 12 {
            let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
            let cut = completion(&server.url, "stories", sampling, Some(&stop));
            assert!(
                want.starts_with(&cut) && cut.len() < want.len() && !cut.contains(&stop),
                "{name}: {stop:?} {cut:?}"
            );
            for m in &models {
                assert_eq!(completion(&coord, m, sampling, Some(&stop)), cut, "{name}: stop {stop:?} over `{m}`");
                // gRPC Generate with the stop string, through the Rust SDK
                let mut args: Vec<String> = vec!["generate".into(), "--model".into(), m.to_string(), "-p".into()];
                args.extend([PROMPT.to_string(), "--json".into(), format!("--stop={stop}")]);
                args.extend(flags(sampling));
                let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let out = c.brigade(&refs);
                assert_eq!(text_of(&out, &format!("generate {name} on {m} --stop")), cut, "{name}: gRPC stop {stop:?}");
                let v: Value = serde_json::from_slice(&out.stdout).unwrap();
                assert_eq!(v["stop"], "stop", "{name} on {m}: {v}");
            }
            let mut kw = sampling.clone();
            kw["stop"] = json!(stop);
            py_cases.push((format!("{name}-stop"), kw));
            reference.insert(format!("{name}-stop"), cut);
        }
        py_cases.push((name.to_string(), sampling.clone()));
        reference.insert(name.to_string(), want);
    }
    // the cases are not one text: each parameter changed what was generated
    let distinct: std::collections::BTreeSet<&String> = cases.iter().map(|(name, _)| &reference[*name]).collect();
    assert_eq!(distinct.len(), cases.len(), "some parameters changed nothing: {reference:#?}");
    assert!(py_cases.len() > cases.len(), "no case was long enough for a stop string");

    let py = python_sdk(&c, &models, &py_cases);
    for m in &models {
        for (name, _) in &py_cases {
            assert_eq!(py[format!("{m}/{name}")].as_str(), Some(reference[name].as_str()), "python SDK {m}/{name}");
        }
    }
    assert!(server.proc.exited().is_none(), "serve died: {}", server.proc.log_text());
}
