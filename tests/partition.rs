//! A coordinator replica cut off from the others (network namespaces; the links between it and
//! the other replicas taken down) cannot commit and answers no read that promises the current
//! state; the majority goes on; when the links come back the cut-off replica follows the
//! majority's log. The cut-off replica is the leader at the time of the cut: the hardest case
//! (it believes it leads until it misses a quorum).
//!
//! Needs root (network namespaces); CI runs as root.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};
use support::netns::Net;
use support::*;

fn status_via(c: &Cluster, net: &Net, addr: &str, timeout: u64) -> Result<serde_json::Value, String> {
    let ca = c.ca();
    let mut cmd = std::process::Command::new("timeout");
    cmd.arg(timeout.to_string()).args(net.exec("c")).arg(BIN);
    cmd.args(["status", "--json", "--coordinator", addr, "--ca", ca.to_str().unwrap()]);
    let out = cmd.output().unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn names(v: &serde_json::Value) -> Vec<String> {
    v["deployments"]
        .as_array()
        .map(|a| a.iter().map(|d| d["name"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

#[test]
fn a_cut_off_replica_cannot_commit_and_follows_the_majority_when_it_returns() {
    assert!(unsafe { libc::geteuid() } == 0, "this test builds network namespaces and needs root (CI runs as root)");
    // nodes 0..3: the replicas r1 r2 r3; node 3: the client and the worker
    let net = Net::new(&["r1", "r2", "r3", "c"]);
    for a in 0..4 {
        for b in a + 1..4 {
            net.link(a, b, None);
        }
    }
    let mut c = Cluster::new();
    let prefix = net.prefix.clone();
    c.wrap = Box::new(move |name| {
        let node = match name.strip_prefix("coordinator-") {
            Some(id) => format!("r{id}"),
            None => "c".to_string(),
        };
        vec!["ip".into(), "netns".into(), "exec".into(), format!("{prefix}{node}")]
    });
    let hosts: Vec<String> = (0..3).map(|i| net.ip(i)).collect();
    c.start_group_at(&hosts);
    let leader = c.wait_leader(Duration::from_secs(30));
    let mut args = c.worker_args("w1");
    let i = args.iter().position(|a| a == "--listen").unwrap();
    args[i + 1] = format!("{}:7071", net.ip(3));
    c.start_worker_with("w1", args);
    c.wait_up(1);
    c.deploy(&["--name", "before", "--device-map", "w1:cpu:5", "--ctx", "64", "--sessions", "1"]);
    let addr = |id: u64| {
        let r = c.replicas.iter().find(|r| r.id == id).unwrap();
        format!("{}:{}", r.host, r.port)
    };
    let cut = leader;
    let others: Vec<u64> = (1..=3).filter(|i| *i != cut).collect();
    let majority = format!("{},{}", addr(others[0]), addr(others[1]));

    // the cut: the leader loses both links to the other replicas (the client still reaches it)
    let t_cut = Instant::now();
    for o in &others {
        net.set_link((cut - 1) as usize, (*o - 1) as usize, false);
    }
    // a write through the cut-off replica does not commit
    let ca = c.ca();
    let mut deploy = std::process::Command::new("timeout");
    deploy.arg("8").args(net.exec("c")).arg(BIN);
    deploy.args([
        "deploy",
        "--name",
        "minority",
        "--device-map",
        "w1:cpu:5",
        "--wait",
        "0",
        "--coordinator",
        &addr(cut),
        "--ca",
        ca.to_str().unwrap(),
    ]);
    let out = deploy.output().unwrap();
    assert!(
        !out.status.success(),
        "a write through the cut-off replica succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // nor does it answer a read that promises the current state
    if let Ok(v) = status_via(&c, &net, &addr(cut), 8) {
        panic!("the cut-off replica answered a current read: {:?} raft {}\n{}", names(&v), v["raft"], c.logs());
    }
    // the majority elects a leader among itself and commits
    let mut new_leader = 0;
    wait_until("the majority to elect a leader", Duration::from_secs(30), || {
        new_leader = status_via(&c, &net, &majority, 5).ok().and_then(|v| v["raft"]["leader"].as_u64()).unwrap_or(0);
        new_leader != 0 && new_leader != cut
    });
    eprintln!(
        "leader {cut} cut off; replica {new_leader} leads the majority {:.1} s after the cut",
        t_cut.elapsed().as_secs_f64()
    );
    let cmd = |args: &[&str]| {
        let mut k = std::process::Command::new("timeout");
        k.arg("30").args(net.exec("c")).arg(BIN).args(args).args([
            "--coordinator",
            &majority,
            "--ca",
            ca.to_str().unwrap(),
        ]);
        let out = k.output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    cmd(&["deploy", "--name", "after", "--device-map", "w1:cpu:5", "--ctx", "64", "--sessions", "1"]);
    cmd(&["undeploy", "before"]);
    // and still no current read through the cut-off replica shows the old state
    if let Ok(v) = status_via(&c, &net, &addr(cut), 6) {
        panic!("the cut-off replica answered a current read with {:?}", names(&v));
    }

    // the links return: the cut-off replica follows the majority's log (its uncommitted write is gone)
    for o in &others {
        net.set_link((cut - 1) as usize, (*o - 1) as usize, true);
    }
    wait_until("the returning replica to follow the majority", Duration::from_secs(60), || {
        status_via(&c, &net, &addr(cut), 10).is_ok_and(|v| names(&v) == ["after"] && v["raft"]["role"] == "follower")
    });
    for id in 1..=3 {
        let v = status_via(&c, &net, &addr(id), 10).unwrap();
        assert_eq!(names(&v), ["after"], "replica {id}");
    }
}
