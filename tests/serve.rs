//! `brigade serve` end to end: the server process on port 0, driven by the official `openai`
//! Python client (tests/serve/openai_client.py, in target/venv, which .ci/run makes):
//! answers equal to `brigade run`'s, usage, streams, stop strings, 16 concurrent streams, bad
//! requests, API keys, a client leaving mid-stream.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{http, root, serve, smollm2, Server, BIN};

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
    // the one box's figures: its stage computed in decode steps, its requests counted
    let m = http_get(&s.url, "/metrics");
    let value = |prefix: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(prefix)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{m}"))
    };
    let stage = "{deployment=\"stories260K.gguf\",stage=\"0\",node=\"this box\",device=\"cpu\"}";
    assert!(value(&format!("brigade_stage_compute_seconds_total{stage}")) > 0.0, "{m}");
    assert!(value(&format!("brigade_stage_kv_cache_bytes{stage}")) > 0.0, "{m}");
    assert!(value("brigade_requests_total{endpoint=\"/v1/completions\",status=\"401\"}") >= 1.0, "{m}");
    assert!(value("brigade_generated_tokens_total") > 0.0);
    let page = http_get(&s.url, "/");
    assert!(page.contains("this box") && page.contains("stories260K.gguf") && !page.contains("<script"));
}

/// Structured output: JSON schemas (`response_format`, llama.cpp's `json_schema`), any JSON
/// object, llguidance grammars, on 20 seeds at temperatures 0 to 1.2, streamed and not; formats
/// that cannot be compiled are 400s naming their field.
#[test]
fn structured_output_is_what_was_asked_at_any_temperature() {
    let mut s = serve(&["--parallel", "2"]);
    client(&mut s, "structured", &[]);
}

/// Tool calls through the official client: on the embedded model's own template (which shows no
/// tools: the generic JSON style) and on a Hermes-style template given by `--chat-template-file`
/// (calls as `<tool_call>` blocks) — forced calls valid at any temperature, streamed and not,
/// `auto`, a history of calls and results, bad tools refused by name.
#[test]
fn tools_are_called_as_asked_in_the_generic_and_hermes_styles() {
    let mut s = serve(&["--parallel", "2"]);
    client(&mut s, "tools", &[]);
    let template = root().join("tests/serve/hermes.jinja");
    let mut s = serve(&["--parallel", "2", "--chat-template-file", template.to_str().unwrap()]);
    client(&mut s, "tools", &["--style", "hermes"]);
}

/// logprobs / top_logprobs through the official client, on both endpoints, streamed and not.
#[test]
fn logprobs_name_the_greedy_choice_and_spell_the_text() {
    let mut s = serve(&["--parallel", "2"]);
    client(&mut s, "logprobs", &[]);
}

#[test]
fn sixteen_concurrent_streams_equal_their_single_session_text() {
    let mut s = serve(&["--parallel", "4"]);
    client(&mut s, "concurrent", &[]);
}

/// Speculative decoding by prompt lookup on SmolLM2: chats that copy code from their prompt come
/// back as `brigade run` writes them without drafts, alone and two at once, and the drafts were
/// taken (`/metrics`); structured output holds with drafts on.
#[test]
fn drafting_servers_answer_with_the_text_of_plain_decoding() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let mut s = serve(&["-m", m, "-c", "2048", "--parallel", "2", "--spec-type", "ngram-simple"]);
    client(&mut s, "speculative", &["--model-file", m, "--ctx", "2048"]);
    let mut s = serve(&["--parallel", "2", "--spec-type", "ngram-simple"]);
    client(&mut s, "structured", &[]);
}

/// Split layers in the server (llama.cpp's `--n-cpu-moe`): a Qwen3-MoE-shaped mixture with the
/// experts of 2 of its 4 layers held in RAM by a shard answers 16 concurrent streams (batched
/// decode steps, prompts read together) with `brigade run`'s text of the whole layers.
#[test]
fn a_mixture_with_experts_in_ram_serves_concurrent_streams_as_run_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("moe.gguf");
    let m = m.to_str().unwrap();
    let shape =
        "--type q4_k --seed 7 --layers 4 --hidden 256 --ffn 256 --heads 4 --kv-heads 2 --vocab 512 --experts 8 \
                 --experts-used 2 --moe-family qwen3moe";
    let out = Command::new(BIN).args(["synth", "-o", m]).args(shape.split_whitespace()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut s = serve(&["-m", m, "--parallel", "4", "--n-cpu-moe", "2"]);
    client(&mut s, "concurrent", &["--model-file", m]);
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
fn the_coordinator_serves_the_api_metrics_and_dashboard_for_a_model_split_across_workers() {
    // a coordinator with --http and a key, two worker processes (one with --metrics), the
    // embedded model split between them: the official client gets what `brigade run` gives,
    // alone and 16 at once; then /metrics (the Prometheus parser), `status` and the dashboard
    // (in a real browser) show the same figures
    let mut c = support::Cluster::new();
    let admin_keys = c.path("admin-keys");
    std::fs::write(&admin_keys, "# the operators' keys\n\ncluster-admin\n").unwrap();
    let admin_keys = admin_keys.display().to_string();
    c.start_coordinator(&["--http", "127.0.0.1:0", "--api-key", "cluster-key", "--admin-key-file", &admin_keys]);
    c.api_key = Some("cluster-key".into());
    // an inference key may not deploy (nor plan): only the admin key may
    let out = c.brigade(&["deploy", "--name", "stories", "--device-map", "w1:cpu:5"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("admin key"), "{out:?}");
    c.api_key = Some("cluster-admin".into());
    c.start_worker("w1", &["--metrics", "127.0.0.1:0"]);
    c.start_worker("w2", &[]);
    c.wait_up(2);
    let d = c.deploy(&["--name", "stories", "--device-map", "w1:cpu:3,w2:cpu:2"]);
    assert_eq!(d["state"], "ready", "{d}");
    c.api_key = Some("cluster-key".into());
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
    // what agents send, constrained and scored on the last worker: JSON schemas and grammars,
    // tool calls, logprobs — the same checks as on one box
    client_at(&url, "structured", &["--key", "cluster-key"], &mut alive);
    client_at(&url, "tools", &["--key", "cluster-key"], &mut alive);
    client_at(&url, "logprobs", &["--key", "cluster-key"], &mut alive);

    // /metrics through the official parser: per stage, per hop, predicted and measured
    let log = c.worker("w1").log_text();
    let worker_url = log
        .lines()
        .find_map(|l| l.split("metrics on ").nth(1)?.strip_suffix("/metrics").map(str::to_string))
        .unwrap_or_else(|| panic!("w1 printed no metrics address:\n{log}"));
    let out = Command::new(python())
        .arg(root().join("tests/serve/metrics_check.py"))
        .args(["--coordinator", &url, "--worker", &worker_url, "--stages", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "metrics: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("ok: "), "{stdout}");
    eprint!("{stdout}");

    // one source: `status` says what /metrics says
    let status = c.status();
    let dep = status["deployments"].as_array().unwrap().iter().find(|d| d["name"] == "stories").unwrap().clone();
    let metrics = http_get(&url, "/metrics");
    let sample = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
    };
    let measured = sample("brigade_deployment_measured_decode_seconds_per_token{deployment=\"stories\"}");
    let predicted = sample("brigade_deployment_predicted_decode_seconds_per_token{deployment=\"stories\"}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12);
    assert!(close(measured * 1e3, dep["measured_decode_ms"].as_f64().unwrap()), "{measured} vs {dep}");
    assert!(close(predicted * 1e3, dep["predicted_decode_ms"].as_f64().unwrap()), "{predicted} vs {dep}");
    assert!(measured > 0.0);

    // the dashboard in a real browser; a screenshot for the record
    let browser = chromium();
    let shot = root().join("target/test-artifacts/dashboard.png");
    std::fs::create_dir_all(shot.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&shot);
    let dom = browse(&browser, &["--dump-dom".to_string()], &url);
    for node in ["w1", "w2"] {
        assert!(dom.contains(&format!("data-node=\"{node}\"")), "node {node} on the page:\n{dom}");
    }
    assert_eq!(dom.matches("<tr class=\"stage\">").count(), 2, "two stages:\n{dom}");
    assert!(dom.contains("<svg"), "the plan's SVG:\n{dom}");
    let rates: Vec<f64> = dom
        .split("stage-tps\" data-tokens-per-s=\"")
        .skip(1)
        .filter_map(|r| r.split('"').next()?.parse().ok())
        .collect();
    assert!(rates.len() == 2 && rates.iter().all(|&r| r > 0.0), "live tokens/s per stage: {rates:?}");
    assert!(dom.contains("Recent requests") && dom.contains("/v1/completions"), "recent requests");
    // the page needs no JavaScript: the server sends it whole, with no script in it (chromium's
    // --dump-dom and --screenshot themselves run scripts, so they cannot run with scripts off)
    let served = http_get(&url, "/");
    assert!(!served.contains("<script") && served.contains("data-node=\"w1\"") && served.contains("stage-tps"));
    browse(&browser, &[format!("--screenshot={}", shot.display()), "--window-size=1400,1800".into()], &url);
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 10_000, "the screenshot {} has {size} bytes", shot.display());
}

/// A plain HTTP GET of `path` (no key needed: /metrics and / are open like /health).
fn http_get(base: &str, path: &str) -> String {
    support::http(base, "GET", path, None)
}

/// Debian's chromium (which .ci/run installs): its binary itself, not the launcher script.
fn chromium() -> String {
    for b in ["/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome"] {
        if Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()) {
            return b.to_string();
        }
    }
    panic!("no chromium: apt-get install chromium (.ci/run does)");
}

/// Runs headless chromium on `url` with `args` (killed after 120 s); returns its stdout.
fn browse(browser: &str, args: &[String], url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let dir = profile.path().join("profile");
    let mut cmd = Command::new(browser);
    cmd.args(["--headless", "--no-sandbox", "--disable-gpu"])
        .arg(format!("--user-data-dir={}", dir.display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("chromium {args:?} took over 120 s");
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr: String =
        String::from_utf8_lossy(&out.stderr).lines().filter(|l| !l.contains("dbus")).collect::<Vec<_>>().join("\n");
    assert!(out.status.success(), "chromium {args:?}: {stderr}");
    assert!(!stdout.is_empty() || !args.iter().any(|a| a == "--dump-dom"), "chromium printed no DOM: {stderr}");
    stdout
}

/// Slow and silent HTTP clients are dropped: a connection that sends nothing, and one that sends
/// a request head a byte every second, are closed within the 10 s header timeout (+2 s); the
/// server keeps answering meanwhile. (The 30 s body deadline is tested in `brigade-serve`'s API
/// tests on a paused clock.)
#[test]
fn slowloris_clients_are_closed_within_the_header_timeout() {
    use std::io::{Read, Write};
    // (a key file that holds no key is refused before anything listens)
    let empty = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(empty.path(), "# no keys yet\n").unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--port", "0", "--api-key-file", empty.path().to_str().unwrap()])
        .env_remove("BRIGADE_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("holds no key"), "{out:?}");
    let s = serve(&["--parallel", "1"]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let t0 = Instant::now();
    let silent = std::net::TcpStream::connect(&addr).unwrap();
    let mut trickle = std::net::TcpStream::connect(&addr).unwrap();
    let head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
    let trickling = std::thread::spawn(move || {
        for b in head {
            if trickle.write_all(&[*b]).is_err() {
                return Some(Instant::now());
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        None
    });
    // the server still answers while both are held
    assert!(http(&s.url, "GET", "/health", None).contains("ok"));
    let mut silent = silent;
    silent.set_read_timeout(Some(Duration::from_secs(14))).unwrap();
    let mut buf = [0u8; 512];
    let read = silent.read(&mut buf);
    let closed_after = t0.elapsed();
    assert!(
        matches!(read, Ok(n) if n == 0 || String::from_utf8_lossy(&buf[..n]).contains("408"))
            || read.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "a silent connection: {read:?} after {closed_after:?}"
    );
    assert!(closed_after < Duration::from_secs(12), "a silent connection was held {closed_after:?}");
    let failed_at = trickling.join().unwrap();
    let held = failed_at.map(|t| t - t0);
    assert!(held.is_some_and(|h| h < Duration::from_secs(14)), "a trickling head was held {held:?}");
}
