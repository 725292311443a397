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
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("deploy/validate.sh"));
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
