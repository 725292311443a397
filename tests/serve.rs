//! `brigade serve` end to end: the server process on port 0, driven by the official `openai`
//! Python client (tests/serve/openai_client.py, in target/venv, which .ci/run makes):
//! answers equal to `brigade run`'s, usage, streams, stop strings, 16 concurrent streams, bad
//! requests, API keys, a client leaving mid-stream.
#![allow(clippy::unwrap_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
use support::{Proc, BIN};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The SmolLM2 GGUF (tests/fetch-smollm2.sh fetches it when missing).
fn smollm2() -> PathBuf {
    if let Ok(p) = std::env::var("BRIGADE_SMOLLM2") {
        return PathBuf::from(p);
    }
    let p = root().join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !p.exists() {
        let st = Command::new("bash").arg(root().join("tests/fetch-smollm2.sh")).status().unwrap();
        assert!(st.success(), "tests/fetch-smollm2.sh failed");
    }
    p
}

/// The Python with `openai` installed: `target/venv`, which `.ci/run` makes.
fn python() -> PathBuf {
    let py = root().join("target/venv/bin/python");
    let ok = Command::new(&py).args(["-c", "import openai, httpx"]).status().is_ok_and(|s| s.success());
    assert!(
        ok,
        "no `openai` in target/venv: run .ci/run, or python3 -m venv target/venv && target/venv/bin/pip install openai==2.54.0"
    );
    py
}

/// A `brigade serve` process on a free port; killed on drop.
struct Server {
    proc: Proc,
    url: String,
    _dir: tempfile::TempDir,
}

fn serve(args: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let mut child = Command::new(BIN)
        .args(["serve", "--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc { name: "serve".into(), child, log };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("no address: {}", proc.log_text()));
    let url = line.split("listening on ").nth(1).and_then(|r| r.split(' ').next()).unwrap().to_string();
    assert!(url.starts_with("http://127.0.0.1:") && !url.ends_with(":0"), "{line}");
    Server { proc, url, _dir: dir }
}

/// Runs one case of the Python script against `server`; asserts it passed and checked something.
fn client(server: &mut Server, case: &str, extra: &[&str]) {
    let url = server.url.clone();
    client_at(&url, case, extra, &mut || (server.proc.exited().is_none(), server.proc.log_text()));
}

/// Runs one case of the Python script against the API at `url`; `alive` says whether the
/// server still runs, and its log.
fn client_at(url: &str, case: &str, extra: &[&str], alive: &mut dyn FnMut() -> (bool, String)) {
    let out = Command::new(python())
        .arg(root().join("tests/serve/openai_client.py"))
        .args([case, "--url", url, "--bin", BIN])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "case {case}: {}\n{stdout}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        alive().1
    );
    let n: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ok: ")?.strip_suffix(" checks")?.parse().ok())
        .unwrap_or_else(|| panic!("case {case} printed no count of checks: {stdout}"));
    assert!(n >= 3, "case {case}: only {n} checks");
    let (up, log) = alive();
    assert!(up, "the server died: {log}");
}

#[test]
fn openai_client_on_the_embedded_model_and_bad_requests() {
    let mut s = serve(&["--api-key", "test-key"]);
    client(&mut s, "openai", &["--key", "test-key"]);
    client(&mut s, "bad", &["--key", "test-key"]);
}

#[test]
fn sixteen_concurrent_streams_equal_their_single_session_text() {
    let mut s = serve(&["--parallel", "4"]);
    client(&mut s, "concurrent", &[]);
}

#[test]
fn smollm2_chat_equals_run_and_a_disconnect_frees_the_slot() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let mut s = serve(&["-m", m, "-c", "2048", "--parallel", "1"]);
    client(&mut s, "smollm2", &["--model-file", m, "--ctx", "2048"]);
    client(&mut s, "disconnect", &[]);
}

#[test]
fn the_coordinator_serves_the_same_api_for_a_model_split_across_workers() {
    // a coordinator with --http and a key, two worker processes, the embedded model split
    // between them: the official client gets what `brigade run` gives, alone and 16 at once
    let mut c = support::Cluster::new();
    c.start_coordinator(&["--http", "127.0.0.1:0", "--api-key", "cluster-key"]);
    c.api_key = Some("cluster-key".into());
    c.start_worker("w1", &[]);
    c.start_worker("w2", &[]);
    c.wait_up(2);
    let d = c.deploy(&["--name", "stories", "--device-map", "w1:cpu:3,w2:cpu:2"]);
    assert_eq!(d["state"], "ready", "{d}");
    let addr = std::fs::read_to_string(c.path("coordinator").join("coordinator.http.addr")).unwrap();
    let url = format!("http://{}", addr.trim());
    let mut alive = || {
        let log = c.logs();
        let up = c.coordinator.as_mut().is_some_and(|p| p.exited().is_none())
            && c.workers.iter_mut().all(|w| w.exited().is_none());
        (up, log)
    };
    client_at(&url, "openai", &["--key", "cluster-key"], &mut alive);
    client_at(&url, "concurrent", &["--key", "cluster-key"], &mut alive);
    client_at(&url, "bad", &["--key", "cluster-key"], &mut alive);
}
