//! The Python SDK's tests (`sdk/python/tests`, pytest) run against this build's binary, so that
//! `cargo test --workspace` covers them: a live `cluster local` (greedy output equal to `run`'s,
//! chat, deploy, status, errors) and a group of three coordinator replicas whose leader is killed
//! mid-stream. They run from `target/venv`, which `.ci/run` makes; the chat test's SmolLM2 is
//! `BRIGADE_SMOLLM2` or `target/models/` (`tests/fetch-smollm2.sh`, which `.ci/run` runs).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

const SETUP: &str = "run .ci/run, or: python3 -m venv target/venv && \
    target/venv/bin/pip install ./sdk/python pytest";

fn venv_python() -> PathBuf {
    let py = root().join("target/venv/bin/python");
    assert!(py.exists(), "{} is missing: {SETUP}", py.display());
    py
}

/// The number before `word` in pytest's summary line ("18 passed, 1 failed in 31.2s").
fn count(summary: &str, word: &str) -> usize {
    let words: Vec<&str> = summary.split(|c: char| c == ',' || c.is_whitespace()).filter(|w| !w.is_empty()).collect();
    words.windows(2).find(|w| w[1] == word).and_then(|w| w[0].parse().ok()).unwrap_or(0)
}

#[test]
fn the_installed_sdk_is_this_source() {
    // the venv holds a built copy: an edit under sdk/python/src must be installed to be tested
    let out = Command::new(venv_python())
        .args(["-c", "import brigade_client, os; print(os.path.dirname(brigade_client.__file__))"])
        .output()
        .unwrap();
    assert!(out.status.success(), "brigade_client is not installed in target/venv: {SETUP}");
    let installed = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let src = root().join("sdk/python/src/brigade_client");
    let mut compared = 0;
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "py") {
            let name = p.file_name().unwrap();
            let there = std::fs::read(installed.join(name)).unwrap_or_default();
            assert!(
                there == std::fs::read(&p).unwrap(),
                "{} differs from the installed copy in {}: target/venv/bin/pip install ./sdk/python",
                p.display(),
                installed.display()
            );
            compared += 1;
        }
    }
    assert!(compared >= 4, "only {compared} modules under {}", src.display());
}

#[test]
fn python_sdk_tests_pass() {
    let out = Command::new(venv_python())
        .current_dir(root())
        .args(["-m", "pytest", "sdk/python/tests", "-p", "no:cacheprovider", "-q", "-rfE"])
        .env("BRIGADE_BIN", env!("CARGO_BIN_EXE_brigade"))
        .env_remove("BRIGADE_CONFIG")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let summary = text.lines().rev().find(|l| l.contains(" in ") && l.contains("passed")).unwrap_or("");
    // exit 5 is pytest's "no tests collected": a failure like any other non-zero code
    assert!(out.status.success(), "pytest exited {:?} (5: no tests collected):\n{text}", out.status.code());
    let passed = count(summary, "passed");
    assert!(passed > 0, "pytest passed no tests:\n{text}");
    assert_eq!(count(summary, "failed") + count(summary, "error") + count(summary, "errors"), 0, "{summary}");
    eprintln!("python SDK: {summary}");
}

#[test]
fn summary_counts_are_read() {
    assert_eq!(count("==== 18 passed, 1 failed in 31.41s ====", "passed"), 18);
    assert_eq!(count("18 passed, 1 failed in 31.41s", "failed"), 1);
    assert_eq!(count("no tests ran in 0.01s", "passed"), 0);
}
