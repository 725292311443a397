//! `deploy/validate.sh` checks the deploy files offline (Kubernetes manifests against the API
//! schemas, compose.yaml against the compose specification's schema, the systemd units with
//! `systemd-analyze verify`); these tests run it on deploy/ and show that each check catches a
//! broken copy of its file.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn validate(dir: Option<&Path>) -> (Output, String) {
    validate_with(&[], dir)
}

fn validate_with(flags: &[&str], dir: Option<&Path>) -> (Output, String) {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("deploy/validate.sh")).args(flags);
    if let Some(d) = dir {
        cmd.arg(d);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_ne!(out.status.code(), Some(2), "validate.sh could not run its tools:\n{text}");
    (out, text)
}

#[test]
fn the_deploy_files_validate() {
    let (out, text) = validate(None);
    assert!(out.status.success(), "{text}");
    for f in [
        "k8s/coordinator.yaml",
        "k8s/worker.yaml",
        "k8s/secret.yaml",
        "k8s/namespace.yaml",
        "compose.yaml",
        "systemd/brigade-coordinator.service",
        "systemd/brigade-worker.service",
    ] {
        assert!(text.lines().any(|l| l.starts_with(&format!("ok: {f} "))), "{f} was not validated:\n{text}");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

#[test]
fn each_check_catches_a_broken_file() {
    // (file, text replaced, replacement): a misspelt field, a wrong type, an unknown directive
    let cases = [
        ("k8s/worker.yaml", "runAsGroup: 10001", "runAsGrup: 10001"),
        ("k8s/coordinator.yaml", "replicas: 3", "replicas: three"),
        ("compose.yaml", "restart: unless-stopped", "restart: [unless-stopped]"),
        ("compose.yaml", "    secrets: [join_token]", "    secretz: [join_token]"),
        ("systemd/brigade-worker.service", "ProtectSystem=strict", "ProtectSytem=strict"),
        ("systemd/brigade-coordinator.service", "ExecStart=/usr/local/bin/brigade", "ExecStart=brigade/bin"),
    ];
    for (file, from, to) in cases {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&root().join("deploy"), tmp.path());
        let path = tmp.path().join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{file} no longer has `{from}`");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
        let (out, text) = validate(Some(tmp.path()));
        assert!(!out.status.success(), "{file} with `{to}` passed:\n{text}");
        assert!(text.lines().any(|l| l.starts_with(&format!("FAIL: {file}"))), "{file} not named:\n{text}");
        assert_eq!(text.lines().filter(|l| l.starts_with("FAIL: ")).count(), 1, "only {file} fails:\n{text}");
    }
}

/// The shipped templates hold placeholder join tokens: noted, not failed; `--filled` (a copy
/// filled in for a deployment) fails on each placeholder or weak token and passes real ones.
#[test]
fn placeholder_join_tokens_are_flagged() {
    let (out, text) = validate(None);
    assert!(out.status.success(), "{text}");
    assert!(text.lines().any(|l| l.starts_with("note: k8s/secret.yaml holds a placeholder")), "{text}");
    let (out, text) = validate_with(&["--filled"], None);
    assert!(!out.status.success(), "the placeholders passed --filled:\n{text}");
    for f in ["k8s/secret.yaml", "systemd/coordinator.env", "systemd/worker.env"] {
        assert!(text.lines().any(|l| l.starts_with(&format!("FAIL: {f}: the join token"))), "{f}:\n{text}");
    }
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&root().join("deploy"), tmp.path());
    let real = brigade_transport::join::new_join_token();
    let fill = |file: &str, from: &str, to: &str| {
        let path = tmp.path().join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{file} no longer has `{from}`");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    };
    fill("k8s/secret.yaml", "REPLACE-with-brg1-and-48-random-hex-characters", &real);
    fill("systemd/coordinator.env", "BRIGADE_JOIN_TOKEN=\n", &format!("BRIGADE_JOIN_TOKEN={real}\n"));
    fill("systemd/worker.env", "BRIGADE_JOIN_TOKEN=\n", "BRIGADE_JOIN_TOKEN=brg1-00000000000000000000000000000000\n");
    let (out, text) = validate_with(&["--filled"], Some(tmp.path()));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("FAIL: systemd/worker.env: the join token is a placeholder or weak: it has fewer than 10"),
        "{text}"
    );
    assert_eq!(text.lines().filter(|l| l.starts_with("FAIL: ")).count(), 1, "{text}");
    fill("systemd/worker.env", "brg1-00000000000000000000000000000000", &real);
    let (out, text) = validate_with(&["--filled"], Some(tmp.path()));
    assert!(out.status.success(), "{text}");
}
