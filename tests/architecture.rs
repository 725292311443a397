//! The dependency rules of ARCHITECTURE.md, checked with `cargo tree`: the pure crates pull in no
//! async runtime, RPC framework, tensor library or consensus library.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn deps(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(["tree", "--offline", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}"])
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

const FORBIDDEN_IN_PURE: [&str; 9] =
    ["tokio", "tonic", "prost", "quinn", "candle-core", "candle-nn", "raft", "raft-proto", "cudarc"];

#[test]
fn core_and_planner_stay_pure() {
    for package in ["brigade-core", "brigade-planner"] {
        let d = deps(package);
        assert!(d.iter().any(|x| x == package), "cargo tree did not list {package}: {d:?}");
        for bad in FORBIDDEN_IN_PURE {
            assert!(!d.iter().any(|x| x == bad), "{package} depends on {bad}");
        }
    }
}

#[test]
fn the_check_sees_real_dependencies() {
    // the same query finds candle under the model crate: the absence above means something
    assert!(deps("brigade-model").iter().any(|x| x == "candle-core"));
}

#[test]
fn dependencies_point_down() {
    // core depends on no other brigade crate; planner and model only on core
    assert!(!deps("brigade-core").iter().any(|x| x.starts_with("brigade-") && x != "brigade-core"));
    for package in ["brigade-planner", "brigade-model"] {
        for d in deps(package) {
            if d.starts_with("brigade-") {
                assert!(d == package || d == "brigade-core", "{package} depends on {d}");
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
