//! The rules of ARCHITECTURE.md, checked: the dependency rules with `cargo tree` (the pure crates
//! and the format crate pull in no async runtime, RPC framework, tensor library or consensus
//! library; …), and, by reading the sources, the module order of the model and the coordinator,
//! where `tonic::Status` is built, the SDK's public types, where `unsafe` is, the documented
//! crates, and a code map that names every module.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn deps(package: &str) -> Vec<String> {
    tree(package, &[])
}

/// The crates `package` names in its own `[dependencies]` (and itself).
fn direct_deps(package: &str) -> Vec<String> {
    tree(package, &["--depth", "1"])
}

fn tree(package: &str, extra: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(["tree", "--offline", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

const FORBIDDEN_IN_PURE: [&str; 8] = ["tokio", "tonic", "prost", "quinn", "raft", "raft-proto", "cudarc", "candle-*"];

fn forbidden(dep: &str) -> bool {
    FORBIDDEN_IN_PURE.iter().any(|bad| match bad.strip_suffix('*') {
        Some(prefix) => dep.starts_with(prefix),
        None => dep == *bad,
    })
}

#[test]
fn core_planner_and_format_stay_pure() {
    // the format crate is what a coordinator reads model files with: it must never link candle
    for package in ["brigade-core", "brigade-planner", "brigade-format"] {
        let d = deps(package);
        assert!(d.iter().any(|x| x == package), "cargo tree did not list {package}: {d:?}");
        if let Some(bad) = d.iter().find(|x| forbidden(x)) {
            panic!("{package} depends on {bad}");
        }
    }
}

#[test]
fn the_check_sees_real_dependencies() {
    // the same query finds candle under the model crate: the absence above means something
    let model = deps("brigade-model");
    assert!(model.iter().any(|x| x == "candle-core") && model.iter().any(|x| forbidden(x)));
}

#[test]
fn dependencies_point_down() {
    // core depends on no other brigade crate; planner and format only on core; the kernels on
    // none; model on format and the kernels
    for (package, below) in [
        ("brigade-core", &[][..]),
        ("brigade-planner", &["brigade-core"][..]),
        ("brigade-format", &["brigade-core"][..]),
        ("brigade-kernels", &[][..]),
        ("brigade-model", &["brigade-core", "brigade-format", "brigade-kernels"][..]),
    ] {
        for d in deps(package) {
            if d.starts_with("brigade-") {
                assert!(d == package || below.contains(&d.as_str()), "{package} depends on {d}");
            }
        }
    }
}

#[test]
fn transport_knows_no_tensors_and_no_raft_and_proto_only_core() {
    let transport = deps("brigade-transport");
    assert!(transport.iter().any(|x| x == "quinn"), "cargo tree did not list quinn: {transport:?}");
    for bad in ["candle-core", "candle-nn", "cudarc", "raft", "raft-proto", "brigade-model", "aws-lc-rs"] {
        assert!(!transport.iter().any(|x| x == bad), "brigade-transport depends on {bad}");
    }
    for d in deps("brigade-proto") {
        assert!(
            !d.starts_with("brigade-") || d == "brigade-proto" || d == "brigade-core",
            "brigade-proto depends on {d}"
        );
    }
}

#[test]
fn the_coordinator_never_links_candle_and_the_worker_never_raft() {
    let c = deps("brigade-coordinator");
    assert!(c.iter().any(|x| x == "brigade-planner"), "cargo tree did not list the planner: {c:?}");
    for bad in ["candle-core", "candle-nn", "candle-transformers", "cudarc", "brigade-model", "brigade-worker"] {
        assert!(!c.iter().any(|x| x == bad), "brigade-coordinator depends on {bad}");
    }
    let w = deps("brigade-worker");
    assert!(w.iter().any(|x| x == "candle-core"));
    for bad in ["raft", "raft-proto", "brigade-coordinator", "brigade-planner"] {
        assert!(!w.iter().any(|x| x == bad), "brigade-worker depends on {bad}");
    }
    let sdk = deps("brigade-sdk");
    for bad in ["candle-core", "brigade-model", "brigade-coordinator", "brigade-worker", "raft"] {
        assert!(!sdk.iter().any(|x| x == bad), "brigade-sdk depends on {bad}");
    }
}

#[test]
fn the_test_kit_is_dev_only_and_links_no_tensor_library() {
    let kit = deps("brigade-testkit");
    assert!(kit.iter().any(|x| x == "brigade-coordinator"), "cargo tree did not list the coordinator: {kit:?}");
    for bad in ["candle-core", "brigade-model", "tokio-test"] {
        assert!(!kit.iter().any(|x| x == bad), "brigade-testkit depends on {bad}");
    }
    for package in ["brigade-cli", "brigade-coordinator", "brigade-worker", "brigade-serve", "brigade-sdk"] {
        assert!(!deps(package).iter().any(|x| x == "brigade-testkit"), "{package} depends on the test kit");
    }
}

#[test]
fn the_cli_reaches_tensors_only_through_the_model_crate() {
    let cli = direct_deps("brigade-cli");
    assert!(cli.iter().any(|x| x == "brigade-model"), "cargo tree did not list the model crate: {cli:?}");
    if let Some(bad) = cli.iter().find(|x| x.starts_with("candle-") || *x == "cudarc") {
        panic!("brigade-cli depends on {bad} directly");
    }
}

#[test]
fn model_modules_point_down() {
    // device → llama → pipeline: the slice never reaches up into the pipeline built from it
    let src = |f: &str| {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../model/src/").to_string() + f).unwrap()
    };
    for (file, above) in [("llama.rs", "pipeline"), ("device.rs", "pipeline"), ("device.rs", "llama")] {
        let text = src(file);
        assert!(!text.contains(&format!("crate::{above}")), "{file} uses crate::{above}");
        assert!(text.contains("use crate::"), "{file} was not read");
    }
}

/// The coordinator's modules and the modules each names (`crate::x`), tests left out; a
/// directory module (`raft/`) is one module.
fn coordinator_imports() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../coordinator/src"));
    let mut graph = std::collections::BTreeMap::new();
    let mut read = |module: String, path: &std::path::Path| {
        let text = std::fs::read_to_string(path).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let names: &mut std::collections::BTreeSet<String> = graph.entry(module.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            let name: String = code[i + 7..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
            if !name.is_empty() && name != module {
                names.insert(name);
            }
        }
    };
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            for f in std::fs::read_dir(&path).unwrap() {
                read(stem.clone(), &f.unwrap().path());
            }
        } else if stem != "lib" {
            read(stem, &path);
        }
    }
    graph
}

#[test]
fn no_module_of_the_coordinator_imports_one_that_imports_it_back() {
    let graph = coordinator_imports();
    assert!(graph["server"].contains("shared") && graph["client"].contains("shared"), "{graph:?}");
    // a depth-first walk from every module; a module met again on the current path is a circle
    fn walk<'a>(
        g: &'a std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        m: &'a str,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| *p == m) {
            let mut circle: Vec<String> = path[i..].iter().map(|s| s.to_string()).collect();
            circle.push(m.to_string());
            return Some(circle);
        }
        path.push(m);
        for next in g.get(m).into_iter().flatten() {
            if let Some(c) = walk(g, next, path) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    for m in graph.keys() {
        if let Some(circle) = walk(&graph, m, &mut Vec::new()) {
            panic!("the coordinator's modules import in a circle: {}", circle.join(" → "));
        }
    }
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    out
}

#[test]
fn the_services_raise_their_errors_and_only_error_rs_maps_them_to_status() {
    let codes = [
        "invalid_argument",
        "not_found",
        "unavailable",
        "internal",
        "permission_denied",
        "unauthenticated",
        "failed_precondition",
        "aborted",
        "already_exists",
        "resource_exhausted",
        "deadline_exceeded",
        "cancelled",
        "unknown",
        "new",
    ];
    let mut mapped = 0;
    for krate in ["coordinator", "worker"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(krate).join("src");
        for path in rust_files(&dir) {
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let built: Vec<&str> = codes.iter().copied().filter(|c| code.contains(&format!("Status::{c}("))).collect();
            if path.ends_with("error.rs") {
                mapped += built.len();
            } else {
                assert!(built.is_empty(), "{} builds a tonic::Status itself ({built:?})", path.display());
            }
        }
    }
    assert!(mapped >= 8, "the check found no mapping in error.rs ({mapped})");
}

#[test]
fn the_grammar_engine_links_no_tensor_library_and_no_runtime() {
    // constrained decoding runs in the server and on a cluster's last worker: pure
    let g = deps("brigade-grammar");
    assert!(g.iter().any(|x| x == "llguidance"), "cargo tree did not list llguidance: {g:?}");
    if let Some(bad) = g.iter().find(|x| forbidden(x)) {
        panic!("brigade-grammar depends on {bad}");
    }
    for d in g.iter().filter(|d| d.starts_with("brigade-")) {
        assert!(
            ["brigade-grammar", "brigade-format", "brigade-core"].contains(&d.as_str()),
            "brigade-grammar depends on {d}"
        );
    }
}

#[test]
fn serve_links_no_tensor_library_and_only_format() {
    // the coordinator puts the same HTTP API on a cluster: the server crate must stay candle-free
    let serve = deps("brigade-serve");
    assert!(serve.iter().any(|x| x == "axum"), "cargo tree did not list axum: {serve:?}");
    for bad in ["candle-core", "candle-nn", "cudarc", "raft", "raft-proto", "brigade-model", "tonic"] {
        assert!(!serve.iter().any(|x| x == bad), "brigade-serve depends on {bad}");
    }
    for d in serve.iter().filter(|d| d.starts_with("brigade-")) {
        assert!(
            ["brigade-serve", "brigade-grammar", "brigade-format", "brigade-core"].contains(&d.as_str()),
            "brigade-serve depends on {d}"
        );
    }
}

/// The Rust SDK's public items, as its sources declare them: every `pub` line (fields, functions,
/// variants' types, re-exports) of `crates/sdk/src`, outside `pub(crate)`; and the protobuf
/// type names its files import (`use brigade_proto::v1::{…}`).
fn sdk_public_lines() -> (Vec<(String, String)>, Vec<String>) {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../crates/sdk/src"));
    let mut out = Vec::new();
    let mut imported = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for stmt in text.split("use brigade_proto::v1::").skip(1) {
            let names = stmt.split(';').next().unwrap_or("");
            imported.extend(
                names
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .filter(|w| w.starts_with(|c: char| c.is_ascii_uppercase()))
                    .map(str::to_string),
            );
        }
        // the unit tests at the end of a file are not API
        let api = text.split("#[cfg(test)]").next().unwrap_or("");
        let mut in_event = false;
        for line in api.lines().map(str::trim) {
            if line.starts_with("pub enum Event") {
                in_event = true;
            } else if in_event && line == "}" {
                in_event = false;
            }
            if (line.starts_with("pub ") && !line.starts_with("pub(crate)")) || in_event {
                out.push((path.display().to_string(), line.to_string()));
            }
        }
    }
    (out, imported)
}

#[test]
fn the_rust_sdk_exposes_no_generated_protobuf_type() {
    let (lines, imported) = sdk_public_lines();
    assert!(lines.iter().any(|(_, l)| l.contains("pub async fn status")), "the scan found no API: {lines:?}");
    assert!(imported.iter().any(|n| n == "GenerateRequest"), "the scan found no import: {imported:?}");
    for (file, line) in &lines {
        assert!(
            !line.contains("v1::") && !line.contains("brigade_proto") && !line.contains("prost"),
            "{file}: `{line}` puts a protobuf type in the SDK's API"
        );
        let words: Vec<&str> = line.split(|c: char| !c.is_alphanumeric() && c != '_').collect();
        if let Some(name) = imported.iter().find(|n| words.contains(&n.as_str())) {
            panic!("{file}: `{line}` puts the protobuf type {name} in the SDK's API");
        }
    }
}

/// `unsafe` lives in the kernels crate (its SIMD, AMX and thread set-up) and nowhere else but
/// the binary's start-up and the format crate's one read-only memory map (which the coordinator
/// uses too): every other crate forbids it, the model runtime included; the format crate and
/// the binary deny it and allow it at those places only.
#[test]
fn unsafe_stays_in_the_kernels() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let allowed_in = |dir: &std::path::Path| {
        let mut allowed = 0;
        let mut stack = vec![dir.join("src")];
        while let Some(d) = stack.pop() {
            for f in std::fs::read_dir(d).unwrap() {
                let p = f.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    allowed += std::fs::read_to_string(&p).unwrap().matches("#[allow(unsafe_code)]").count();
                }
            }
        }
        allowed
    };
    let mut checked = 0;
    for e in std::fs::read_dir(&crates).unwrap() {
        let dir = e.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let root = ["lib.rs", "main.rs"].iter().map(|f| dir.join("src").join(f)).find(|p| p.is_file());
        let Some(root) = root else { continue };
        if name == "kernels" {
            continue;
        }
        let text = std::fs::read_to_string(&root).unwrap();
        match name.as_str() {
            "format" | "cli" => {
                assert!(text.contains("#![deny(unsafe_code)]"), "crates/{name} denies unsafe_code");
                // format: its memory map; cli: mimalloc's purge delay, the thread count set
                // before any thread starts, a child's parent-death signal
                let want = if name == "format" { 1 } else { 3 };
                assert_eq!(allowed_in(&dir), want, "crates/{name} allows unsafe_code at {want} places only");
            }
            _ => assert!(text.contains("#![forbid(unsafe_code)]"), "crates/{name} does not forbid unsafe_code"),
        }
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} crates read under {}", crates.display());
}

/// The crates other crates and users build on (the domain types, the planner, the Rust SDK)
/// document every public item and export nothing unreachable: their lib.rs warns of both.
#[test]
fn the_shared_crates_document_their_public_items() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for name in ["core", "planner", "sdk"] {
        let text = std::fs::read_to_string(crates.join(name).join("src/lib.rs")).unwrap();
        let lints: String = text.lines().filter(|l| l.starts_with("#![")).collect();
        for lint in ["missing_docs", "unreachable_pub"] {
            assert!(lints.contains(lint), "crates/{name}/src/lib.rs does not warn of {lint}: {lints}");
        }
    }
}

/// The code map of ARCHITECTURE.md names every module: each `.rs` file under `crates/*/src`,
/// by its path under `src/` in backticks (`stage.rs`, `llama/decode_attn.rs`, `raft/mod.rs`),
/// within its crate's subsection (from the heading that starts "### `crates/NAME`" to the next
/// `##` or `###` heading). A crate root (`lib.rs` or `main.rs` directly under `src/`) is the
/// crate itself and needs no mention; a directory module's `mod.rs` is named as such.
#[test]
fn the_code_map_names_every_module() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let mut crates: Vec<std::path::PathBuf> =
        std::fs::read_dir(root.join("crates")).unwrap().map(|e| e.unwrap().path()).collect();
    crates.sort();
    let (mut checked, mut missing) = (0, Vec::new());
    for dir in crates {
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let heading = format!("### `crates/{name}`");
        let section: Vec<&str> = doc
            .lines()
            .skip_while(|l| !l.starts_with(&heading))
            .enumerate()
            .take_while(|(i, l)| *i == 0 || !(l.starts_with("## ") || l.starts_with("### ")))
            .map(|(_, l)| l)
            .collect();
        let section = section.join("\n");
        let mut files = rust_files(&src);
        files.sort();
        for path in files {
            let parts: Vec<String> = path
                .strip_prefix(&src)
                .unwrap()
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let rel = parts.join("/");
            if rel == "lib.rs" || rel == "main.rs" {
                continue;
            }
            checked += 1;
            if !section.contains(&format!("`{rel}`")) {
                missing.push(format!("crates/{name}/src/{rel}"));
            }
        }
    }
    assert!(checked >= 100, "only {checked} modules found under {}", root.join("crates").display());
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's code map does not name {} module(s) in their crate's subsection (as `path/under/src.rs`): {}",
        missing.len(),
        missing.join(", ")
    );
}
